"""Grammar-constrained decoding, as an offline caller sees it: SmolLM2, greedy unless a test says otherwise."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import msgspec
import pytest

from hybridserve.config import EngineConfig
from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.llm import LLM
from hybridserve.engine.protocol import AddRequest, EngineCoreRequest, EngineInput, FinishReason
from hybridserve.router.deploy import build_engine
from hybridserve.sampling_params import InvalidParameter, SamplingParams, StructuredOutput

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}
PERSON_SPEC = StructuredOutput(json_schema=json.dumps(PERSON))
ASK = "Describe a person as JSON with a name, an age and a favourite color."


def _params(spec: StructuredOutput | None, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 60), structured_output=spec, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(str(smollm2_dir), dtype="float32", device="cpu", kv_cache_prefault=False)


@pytest.fixture(scope="module")
def ask(llm: LLM) -> list[int]:
    return llm.chat_prompt([{"role": "user", "content": ASK}])


def _done(llm: LLM) -> None:
    llm.core.check_integrity()
    assert llm.core.kv.usage == 0.0
    assert not llm.core.scheduler.requests and not llm.core._compiling


def test_json_schema_output_validates(llm, ask):
    out = llm.generate([ask], _params(PERSON_SPEC))[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), PERSON)
    _done(llm)


def test_json_object_output_is_an_object(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": "Give me a JSON object about the weather."}])
    out = llm.generate([prompt], _params(StructuredOutput(json_object=True)))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


def test_regex_output_matches_in_full(llm):
    pattern = r"(yes|no), because [a-z ]{5,40}\."
    prompt = llm.chat_prompt([{"role": "user", "content": "Is the sea blue? Answer yes or no and say why."}])
    out = llm.generate([prompt], _params(StructuredOutput(regex=pattern)))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert re.fullmatch(pattern, out.text), out.text


def test_ebnf_grammar_picks_an_alternative(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    spec = StructuredOutput(grammar='root ::= "Paris" | "London" | "Rome"')
    out = llm.generate([prompt], _params(spec))[0].outputs[0]
    assert out.text in ("Paris", "London", "Rome") and out.finish_reason == "stop"


def _run_core(llm: LLM, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    """Step the engine core until the requests finish; each one's output token ids."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        llm.core.add_request(r)
    while llm.core.has_work():
        for out in llm.core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    _done(llm)
    return tokens


def test_unconstrained_neighbours_are_untouched(llm, ask):
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    others = [
        EngineCoreRequest(f"plain-{t}", llm.chat_prompt([{"role": "user", "content": f"About {t}."}]), plain, [2], 0.0)
        for t in ("cats", "the moon")
    ]
    alone = {}
    for r in others:
        alone |= _run_core(llm, [r])
    constrained = EngineCoreRequest("constrained", ask, _params(PERSON_SPEC), [2], 0.0)
    mixed = _run_core(llm, [constrained, *others])
    assert {k: v for k, v in mixed.items() if k != "constrained"} == alone
    jsonschema.validate(json.loads(llm.tokenizer.decode(mixed["constrained"], skip_special_tokens=True)), PERSON)


def test_n_choices_each_follow_the_schema_and_seeds_reproduce(llm, ask):
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=60, structured_output=PERSON_SPEC)
    first = llm.generate([ask], params)[0].outputs
    again = llm.generate([ask], params)[0].outputs
    assert [o.text for o in first] == [o.text for o in again]
    for out in first:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    _done(llm)


def test_max_tokens_truncates_to_partial_json_with_length(llm, ask):
    full = llm.generate([ask], _params(PERSON_SPEC))[0].outputs[0]
    cut = llm.generate([ask], _params(PERSON_SPEC, max_tokens=5))[0].outputs[0]
    assert cut.finish_reason == "length"
    assert full.text.startswith(cut.text) and len(cut.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)
    _done(llm)


def test_grammar_end_stops_even_with_ignore_eos(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": "Say yes."}])
    out = llm.generate([prompt], _params(StructuredOutput(regex="yes|no"), ignore_eos=True))[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_logprobs_are_the_raw_model_distribution(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": "Name a colour."}])
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))[0].outputs[0]
    spec = StructuredOutput(grammar='root ::= "zebra"')
    forced = llm.generate([prompt], _params(spec, max_tokens=1, logprobs=3))[0].outputs[0]
    assert forced.logprobs is not None and free.logprobs is not None
    # The alternatives are the unconstrained model's; the forced token keeps its raw (low) logprob.
    assert [t.token_id for t in forced.logprobs[0].top] == [t.token_id for t in free.logprobs[0].top]
    assert forced.token_ids[0] != free.token_ids[0]
    assert forced.logprobs[0].logprob < free.logprobs[0].logprob


@pytest.mark.parametrize(
    ("spec", "param", "words"),
    [
        (StructuredOutput(json_schema="{not json"), "structured_output.json_schema", "not valid JSON"),
        (StructuredOutput(json_schema='{"type": "objec"}'), "structured_output.json_schema", 'type "objec"'),
        (StructuredOutput(json_schema="[1]"), "structured_output.json_schema", "must be a JSON object"),
        (StructuredOutput(regex="a(b"), "structured_output.regex", "parenthesis is not closed"),
        (StructuredOutput(grammar="root ::= foo"), "structured_output.grammar", 'Rule "foo" is not defined'),
        (StructuredOutput(structural_tag='{"type": "nope"}'), "structured_output.structural_tag", "invalid"),
    ],
)
def test_invalid_spec_is_refused_before_the_engine(llm, ask, spec, param, words):
    with pytest.raises(InvalidParameter) as err:
        llm.generate([ask], _params(spec))
    assert err.value.param == param
    assert words in str(err.value) and "/project/cpp" not in str(err.value)
    assert not llm.core.has_work()


def test_spec_shape_is_checked_at_construction():
    with pytest.raises(InvalidParameter, match="exactly one of") as err:
        StructuredOutput(regex="a", grammar='root ::= "a"')
    assert err.value.param == "structured_output"
    with pytest.raises(InvalidParameter, match="exactly one of"):
        StructuredOutput()
    with pytest.raises(InvalidParameter) as err:
        StructuredOutput(regex="a", flexible_whitespace=True)
    assert err.value.param == "structured_output.flexible_whitespace"
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(min_tokens=2, structured_output=StructuredOutput(regex="a"))
    assert err.value.param == "min_tokens"


def test_spec_crosses_the_process_boundary():
    request = EngineCoreRequest("r", [1, 2], _params(PERSON_SPEC), [2], 0.0)
    wire = msgspec.msgpack.Encoder().encode(AddRequest(request))
    decoded = msgspec.msgpack.Decoder(EngineInput).decode(wire)
    assert isinstance(decoded, AddRequest) and decoded.request == request


def test_engine_fails_only_the_request_whose_spec_does_not_compile(llm, ask):
    """A client that skips the frontend's check gets an error for that request; its neighbour runs on."""
    llm.core.add_request(EngineCoreRequest("bad", ask, _params(StructuredOutput(regex="a(b")), [2], 0.0))
    llm.core.add_request(EngineCoreRequest("good", ask, _params(None, max_tokens=4), [2], 0.0))
    finished = {}
    while llm.core.has_work():
        for out in llm.core.step().outputs:
            if out.finish_reason is not None:
                finished[out.request_id] = out
    assert finished["bad"].finish_reason == FinishReason.ERROR
    assert "structured_output.regex" in (finished["bad"].error or "")
    assert finished["good"].finish_reason == FinishReason.LENGTH
    _done(llm)


def test_abort_while_compiling_or_running(llm, ask):
    spec = StructuredOutput(json_schema=json.dumps({**PERSON, "title": "abort test"}))  # a new compile
    llm.core.add_request(EngineCoreRequest("early", ask, _params(spec), [2], 0.0))
    llm.core.abort(["early"])
    assert llm.core.step().outputs[0].finish_reason == FinishReason.ABORT
    llm.core.add_request(EngineCoreRequest("late", ask, _params(spec), [2], 0.0))
    while not llm.core.scheduler.running:
        llm.core.step()
    llm.core.step()
    llm.core.abort(["late"])
    assert llm.core.step().outputs[0].finish_reason == FinishReason.ABORT
    _done(llm)


def test_preemption_keeps_the_output(smollm2_dir, llm):
    prompts = [llm.chat_prompt([{"role": "user", "content": f"Describe {who} as JSON."}]) for who in WHO]
    params = _params(PERSON_SPEC)
    reference = [o.outputs[0].text for o in llm.generate(prompts, params)]
    tight = LLM(
        str(smollm2_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=40, kv_cache_prefault=False
    )
    outs = [o.outputs[0] for o in tight.generate(prompts, params)]
    assert tight.core.scheduler.num_preemptions > 0
    assert [o.text for o in outs] == reference
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    _done(tight)


WHO = ("a pilot", "a baker", "a child", "a painter")


def test_through_the_worker_process(smollm2_dir):
    """The async client: the spec crosses ZeroMQ to a worker process, which compiles and applies it."""

    async def main(engine: AsyncLLM) -> tuple[str | None, str]:
        messages = [{"role": "user", "content": ASK}]
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        with pytest.raises(InvalidParameter):
            async for _ in engine.generate(prompt, _params(StructuredOutput(regex="a(b")), "bad"):
                pass
        last = [out async for out in engine.generate(prompt, _params(PERSON_SPEC), "good")][-1].output
        return last.finish_reason, last.text

    engine = build_engine(
        EngineConfig.of(model=str(smollm2_dir), dtype="float32", device="cpu", kv_cache_prefault=False)
    )
    try:
        finish_reason, text = asyncio.run(main(engine))
    finally:
        engine.shutdown()
    assert finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
