"""Suffix drafting (`method: "suffix"`): the proposer's exact drafts on hand-made sequences, its bounded memory
and cross-request cache, and in the engine the same token ids as plain decoding on every path."""

from __future__ import annotations

import dataclasses
import random

import pytest

from hybridserve.engine.llm import LLM
from hybridserve.engine.suffix_drafting import SuffixProposer, SuffixTrie
from hybridserve.sampling_params import InvalidParameter, SamplingParams
from hybridserve.speculative import SpeculativeConfig, parse_speculative_config

SUFFIX = SpeculativeConfig("suffix", 4)
# The engine tests take drafts as deep as the trees offer; the scheduler's sizing is test_spec_decode's.
DEEP = SpeculativeConfig("suffix", 4, weight_read_tokens=float("inf"))
TEXT = "The quick brown fox jumps over the lazy dog while the farmer sleeps under the old oak tree."
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


# --- configuration ---------------------------------------------------------------------------------------------


def test_config_parses_vllm_keys():
    text = (
        '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 16, '
        '"suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2, '
        '"suffix_decoding_min_token_prob": 0.25}'
    )
    assert parse_speculative_config(text) == SpeculativeConfig(
        "suffix",
        8,
        suffix_decoding_max_tree_depth=16,
        suffix_decoding_max_cached_requests=0,
        suffix_decoding_max_spec_factor=2,
        suffix_decoding_min_token_prob=0.25,
    )


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ('"suffix_decoding_max_tree_depth": 1', "max_tree_depth must be an integer of at least 2, got 1"),
        ('"suffix_decoding_max_cached_requests": -1', "suffix_decoding_max_cached_requests .* got -1"),
        ('"suffix_decoding_max_cached_requests": 2.5', "suffix_decoding_max_cached_requests .* got 2.5"),
        ('"suffix_decoding_max_spec_factor": 0', "suffix_decoding_max_spec_factor must be a number above 0, got 0"),
        ('"suffix_decoding_min_token_prob": 1.5', "suffix_decoding_min_token_prob .* got 1.5"),
        ('"suffix_decoding_min_token_prob": "high"', "suffix_decoding_min_token_prob .* got 'high'"),
        ('"prompt_lookup_max": 6', r"prompt_lookup_max \(6\) applies to method 'ngram', not 'suffix'"),
        ('"suffix_depth": 6', "unknown keys \\['suffix_depth'\\]"),
    ],
)
def test_config_errors_name_the_bad_value(keys, named):
    with pytest.raises(InvalidParameter, match=named) as info:
        parse_speculative_config(f'{{"method": "suffix", "num_speculative_tokens": 4, {keys}}}')
    assert info.value.param == "speculative_config"


def test_a_suffix_key_under_ngram_is_an_error():
    with pytest.raises(InvalidParameter, match=r"suffix_decoding_min_token_prob \(0.5\) applies to method 'suffix'"):
        SpeculativeConfig("ngram", 4, suffix_decoding_min_token_prob=0.5)


# --- the proposer ----------------------------------------------------------------------------------------------


def _proposer(num_speculative_tokens: int = 8, **keys) -> SuffixProposer:
    keys.setdefault("suffix_decoding_max_cached_requests", 0)
    return SuffixProposer(SpeculativeConfig("suffix", num_speculative_tokens, **keys))


def _draft(proposer: SuffixProposer, tokens: list[int], max_tokens: int = 8) -> list[int]:
    """A fresh request's draft after `tokens`; it ends with no output to cache."""
    draft = proposer.propose("r", tokens, [], max_tokens)
    proposer.finish("r", [])
    return draft


def test_draft_length_follows_the_match_length():
    proposer = _proposer()
    assert _draft(proposer, [1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]  # "1 2 3" matched: three tokens
    assert _draft(proposer, [5, 6, 7, 8, 9, 5]) == [6]  # "5" only: one (prompt lookup would propose 6 7 8 9)
    assert _draft(proposer, [1, 2, 3, 4, 5, 1, 2, 3], max_tokens=2) == [4, 5]  # the step's room
    assert _draft(proposer, [1, 2, 3, 4]) == []  # nothing repeats
    twice = _proposer(suffix_decoding_max_spec_factor=2.0)
    # Up to six tokens, but the continuation ends at the last token: what follows it is not known yet.
    assert _draft(twice, [1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1, 2, 3]


def test_the_tree_depth_bounds_match_plus_draft():
    proposer = _proposer(suffix_decoding_max_tree_depth=4, suffix_decoding_max_spec_factor=4.0)
    assert _draft(proposer, [1, 2, 3, 4, 5, 6, 1, 2, 3]) == [4]  # "1 2 3" and one more token fill depth 4
    assert _draft(proposer, [1, 2, 3, 4, 5, 6, 9, 1, 2]) == [3, 4]


def test_the_most_frequent_continuation_wins_above_the_probability_floor():
    # "1 2" went on with 7 twice and with 8 once (the most recent): 7, with probability 2/3; after "1 2 7",
    # 30 and 31 are as frequent (the one seen first latest, 31, is taken): probability 1/3 for the two tokens.
    tokens = [1, 2, 7, 30, 1, 2, 7, 31, 1, 2, 8, 32, 1, 2]
    assert _draft(_proposer(), tokens) == [7, 31]
    assert _draft(_proposer(suffix_decoding_min_token_prob=0.5), tokens) == [7]
    assert _draft(_proposer(suffix_decoding_min_token_prob=0.7), tokens) == []


def test_a_request_s_trie_grows_by_its_new_tokens_and_goes_when_it_ends():
    proposer = _proposer(suffix_decoding_max_tree_depth=6)
    prompt = [1, 2, 3, 4, 5]
    assert proposer.propose("a", prompt, [9], 4) == []
    track = proposer.tracks["a"]
    trie, nodes = track.trie, track.trie.num_nodes
    assert proposer.propose("a", prompt, [9, 1, 2], 4) == [3, 4]
    assert proposer.tracks["a"].trie is trie and track.seen == 8
    assert nodes < trie.num_nodes <= nodes + 2 * 6  # two tokens appended: at most depth nodes each
    proposer.finish("a", [9, 1, 2])
    assert proposer.tracks == {}


def test_memory_is_bounded_by_depth_per_token_and_removal_frees_every_node():
    rng = random.Random(0)
    sequences = [[rng.randrange(6) for _ in range(200)] for _ in range(3)]
    trie = SuffixTrie(5)
    for tokens in sequences:
        trie.insert(tokens)
    assert trie.num_nodes <= 1 + 5 * 600
    alone = SuffixTrie(5)
    alone.insert(sequences[1])
    trie.remove(sequences[0])
    trie.remove(sequences[2])
    assert trie.num_nodes == alone.num_nodes
    for start in range(len(sequences[1]) - 3):
        pattern = sequences[1][start : start + 3]
        assert _continued(trie, pattern) == _continued(alone, pattern)
    trie.remove(sequences[1])
    assert trie.num_nodes == 1 and trie.continued(0) == 0


def _continued(trie: SuffixTrie, tokens: list[int]) -> int:
    node = trie.find(tokens)
    assert node is not None
    return trie.continued(node)


def test_a_later_request_drafts_from_an_earlier_output():
    proposer = _proposer(suffix_decoding_max_cached_requests=2)
    earlier = list(range(10, 30))
    running = proposer.propose("running", [50, 51], [10], 4)  # started before the earlier one finished
    assert running == []
    proposer.finish("earlier", earlier)
    assert proposer.propose("later", [99, 10, 11, 12], [], 8) == [13, 14, 15]  # "10 11 12" matched in it
    assert proposer.propose("running", [50, 51], [10, 11], 8) == [12, 13]  # its suffixes found again
    for i, output in enumerate([[1, 2, 3], [4, 5, 6]]):  # two more finish: the earliest output leaves
        proposer.finish(f"next-{i}", output)
    assert list(proposer.cached_outputs) == [[1, 2, 3], [4, 5, 6]]
    assert proposer.propose("last", [10, 11, 12], [], 8) == []
    proposer.finish("short", [7])  # one token has nothing to follow
    assert len(proposer.cached_outputs) == 2
    assert _proposer().propose("off", [99, 10, 11, 12], [], 8) == []  # max_cached_requests 0: no cache


# --- the engine: exact token ids against plain decoding -----------------------------------------------------------


def _llm(hf_dir, **config) -> LLM:
    return LLM(str(hf_dir), dtype="float32", device="cpu", **config, kv_cache_prefault=False)


@pytest.fixture(scope="module")
def base(smollm2_dir) -> LLM:
    return _llm(smollm2_dir)


@pytest.fixture(scope="module")
def suffix(smollm2_dir) -> LLM:
    return _llm(smollm2_dir, speculative_config=DEEP)


@pytest.fixture(scope="module")
def tight(smollm2_dir) -> LLM:
    """A step budget under one prompt's length and a KV cache too small for the batch."""
    return _llm(smollm2_dir, speculative_config=DEEP, max_num_batched_tokens=40, num_kv_blocks=12)


def _prompts(llm: LLM, texts: list[str]) -> list[list[int]]:
    return [llm.chat_prompt([{"role": "user", "content": f"Repeat this exactly: {t}"}]) for t in texts]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    outs = llm.generate(prompts, params)
    llm.core.check_integrity()
    assert llm.core.kv.usage == 0.0, "finished requests still hold blocks"
    proposer = llm.core.scheduler.proposer
    assert proposer is None or not getattr(proposer, "tracks", {}), "finished requests still hold a trie"
    return outs


def _ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _counts(llm: LLM) -> tuple[int, int]:
    stats = llm.core.stats()
    return stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


def test_greedy_batch_is_identical_and_counted(base, suffix):
    prompts = _prompts(base, [TEXT, "one two three four five six seven eight nine ten", "Roses are red."])
    drafted, accepted = _counts(suffix)
    assert _ids(_run(suffix, prompts)) == _ids(_run(base, prompts))
    now_drafted, now_accepted = _counts(suffix)
    assert 0 < now_accepted - accepted <= now_drafted - drafted


def test_a_repeated_request_drafts_from_the_cached_output(base, suffix):
    """The second time, the same prompt's output is in the cross-request trie: more of its drafts are kept."""
    prompts = _prompts(base, ["Name three colours and three animals, then three fruits."])
    expected = _ids(_run(base, prompts))
    runs = []
    for _ in range(2):
        before = _counts(suffix)
        assert _ids(_run(suffix, prompts)) == expected
        runs.append(_counts(suffix)[1] - before[1])
    assert runs[1] > runs[0]
    assert expected[0][0] in list(suffix.core.scheduler.proposer.cached_outputs)  # type: ignore[union-attr]


def test_logprobs_match(base, suffix):
    params = dataclasses.replace(GREEDY, logprobs=3, max_tokens=24)
    prompts = _prompts(base, [TEXT])
    [want], [got] = _run(base, prompts, params)[0].outputs, _run(suffix, prompts, params)[0].outputs
    assert got.token_ids == want.token_ids
    assert want.logprobs is not None and got.logprobs is not None
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert (a.token_id, a.rank, [t.token_id for t in a.top]) == (b.token_id, b.rank, [t.token_id for t in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_stop_strings_inside_an_accepted_run(base, suffix):
    prompts = _prompts(base, [TEXT])
    stop_word = dataclasses.replace(GREEDY, stop=("lazy",))
    want = _run(base, prompts, stop_word)[0].outputs[0]
    got = _run(suffix, prompts, stop_word)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")


def test_chunked_prefill_and_preemption(base, tight):
    texts = [TEXT + " " + TEXT, "one two three four five six seven eight nine ten", "Roses are red.", TEXT[:40]]
    prompts = _prompts(base, texts)
    assert len(prompts[0]) > 40
    preemptions, (_, accepted) = tight.core.stats().num_preemptions, _counts(tight)
    assert _ids(_run(tight, prompts)) == _ids(_run(base, prompts))
    assert tight.core.stats().num_preemptions > preemptions
    assert _counts(tight)[1] > accepted


def test_hybrid_model_rolls_rejected_drafts_back(kimi_linear_dir):
    base, spec = _llm(kimi_linear_dir), _llm(kimi_linear_dir, speculative_config=DEEP)
    prompts = _prompts(base, [TEXT, "abc abc abc abc abc", "1 2 3 1 2 3 1 2"])
    assert _ids(_run(spec, prompts)) == _ids(_run(base, prompts))
    drafted, accepted = _counts(spec)
    assert accepted < drafted  # some were rolled out of the recurrent state
