"""Forced tool calls (tool_choice "required" or a named function) against the scripted engine: every complete
call comes out as a call, streamed as soon as it closes; a call cut short is dropped, never given back as text;
the grammar caps a forced turn at MAX_FORCED_CALLS calls."""

import json

import openai
import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from hybridserve.serving.openai import tools
from hybridserve.serving.openai.forced import ArrayElements, RequiredCallsParser
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import sse_payloads
from tests.serving.openai.responses.test_responses import events
from tests.serving.openai.test_tools import CHAT_TOOLS, TOOLS, script
from tests.serving.openapi_schema import check

CITIES = ("Paris", "Rome", "Oslo")
LOOP = "[" + ", ".join(f'{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}' for city in CITIES) + "]"
CALLS = [("get_weather", json.dumps({"city": city})) for city in CITIES]
ASK = "Weather in Paris, Rome and Oslo?"
MESSAGES = [{"role": "user", "content": ASK}]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


@pytest.fixture
def engine(tokenizer):
    return FakeEngine(tokenizer, [script(tokenizer, LOOP)], max_model_len=1024)


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, None)) as client:
        yield client


def cut_in_third_call(tokenizer) -> int:
    """A max_tokens that ends the output inside the third call, two calls complete."""
    ids = tokenizer.encode(LOOP, add_special_tokens=False)
    cut = len(ids) - 6
    text = tokenizer.decode(ids[:cut])
    assert text.count("}}") == 2 and '"Oslo"}}' not in text, text
    return cut


def responses(client, **body):
    return client.post("/v1/responses", json={"input": ASK, "tools": TOOLS, "tool_choice": "required", **body})


def chat(client, **body):
    return client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "tools": CHAT_TOOLS, "tool_choice": "required", **body}
    )


def function_calls(output: list[dict]) -> list[tuple[str, str]]:
    assert all(item["type"] == "function_call" and item["status"] == "completed" for item in output), output
    return [(item["name"], item["arguments"]) for item in output]


def test_responses_every_call_of_the_list(client):
    body = responses(client).json()
    check(body, "Response")
    assert function_calls(body["output"]) == CALLS
    assert (body["status"], body["incomplete_details"]) == ("completed", None)


def test_responses_cut_short_drops_the_cut_call_and_is_incomplete(client, tokenizer):
    body = responses(client, max_output_tokens=cut_in_third_call(tokenizer)).json()
    check(body, "Response")
    assert function_calls(body["output"]) == CALLS[:2]  # no message with the raw JSON
    assert (body["status"], body["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert client.get(f"/v1/responses/{body['id']}").json() == body


def test_responses_stream_sends_each_call_then_incomplete(client, tokenizer):
    evs = events(responses(client, max_output_tokens=cut_in_third_call(tokenizer), stream=True).text)
    assert [e["type"] for e in evs] == [
        "response.created",
        "response.in_progress",
        *CALL_EVENTS,
        *CALL_EVENTS,
        "response.incomplete",
    ]
    final = evs[-1]["response"]
    assert function_calls(final["output"]) == CALLS[:2]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    for k, item in enumerate(final["output"]):
        added, delta, done, item_done = evs[2 + 4 * k : 6 + 4 * k]
        assert added["item"] == {**item, "arguments": "", "status": "in_progress"}
        where = {"item_id": item["id"], "output_index": k}
        assert {key: delta[key] for key in (*where, "delta")} == {**where, "delta": item["arguments"]}
        assert (done["name"], done["arguments"], done["item_id"]) == (item["name"], item["arguments"], item["id"])
        assert (item_done["output_index"], item_done["item"]) == (k, item)


def test_chat_every_call_and_finish_reason(client, tokenizer):
    body = chat(client).json()
    check(body, "CreateChatCompletionResponse")
    [choice] = body["choices"]
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == CALLS
    assert (choice["message"]["content"], choice["finish_reason"]) == (None, "tool_calls")

    [choice] = chat(client, max_tokens=cut_in_third_call(tokenizer)).json()["choices"]
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == CALLS[:2]
    # cut by max_tokens: "length", as OpenAI reports it, with the calls that were complete
    assert (choice["message"]["content"], choice["finish_reason"]) == (None, "length")


def test_chat_stream_sends_each_call_then_length(client, tokenizer):
    chunks = sse_payloads(chat(client, max_tokens=cut_in_third_call(tokenizer), stream=True).text)
    assert chunks[-1] == "[DONE]"
    for chunk in chunks[:-1]:
        check(chunk, "CreateChatCompletionStreamResponse")
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [delta["tool_calls"] for delta in deltas[1:-1]]
    assert [[(c["index"], c["type"], c["function"]) for c in call] for call in calls] == [
        [(k, "function", {"name": name, "arguments": arguments})] for k, (name, arguments) in enumerate(CALLS[:2])
    ]
    assert deltas[-1] == {} and chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_a_named_call_cut_short_is_no_call_and_no_text(client, engine, tokenizer):
    engine.scripts = [script(tokenizer, '{"city": "Paris"}')]
    named = {"type": "function", "function": {"name": "get_weather"}}
    [choice] = chat(client, tool_choice=named, max_tokens=3).json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "", "refusal": None}
    assert choice["finish_reason"] == "length"
    body = responses(client, tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=3).json()
    assert body["status"] == "incomplete"
    [message] = body["output"]  # an empty output still has its (empty) message
    assert (message["type"], message["content"][0]["text"]) == ("message", "")


def test_the_grammar_caps_a_forced_turn(client, engine):
    responses(client)
    schema = json.loads(engine.calls[-1][1].structured_output.json_schema)
    assert (schema["minItems"], schema["maxItems"]) == (1, tools.MAX_FORCED_CALLS)
    responses(client, parallel_tool_calls=False)
    schema = json.loads(engine.calls[-1][1].structured_output.json_schema)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)


def test_each_call_comes_out_with_the_token_that_closes_it(tokenizer):
    parser = RequiredCallsParser()
    ids = tokenizer.encode(LOOP, add_special_tokens=False)
    seen, closed_at = 0, []
    for i, token in enumerate(ids):
        seen += len(parser.feed(tokenizer.decode([token])))
        if seen > len(closed_at):
            closed_at.append(i)
    assert parser.finish() == [] and seen == len(CALLS)
    # the first token after which the text holds k + 1 closed calls
    closes = [tokenizer.decode(ids[: i + 1]).count("}}") for i in range(len(ids))]
    assert closed_at == [closes.index(k) for k in range(1, len(CALLS) + 1)]


@pytest.mark.parametrize(
    "text, elements",
    [
        ('[{"a": 1}, {"b": [2, {"c": 3}]}]', ['{"a": 1}', '{"b": [2, {"c": 3}]}']),
        ('[{"s": "}]{[\\"\\\\"}, {"t": ""}]', ['{"s": "}]{[\\"\\\\"}', '{"t": ""}']),
        ('[{"a": 1}, {"b": "cut', ['{"a": 1}']),
        ("[", []),
    ],
)
def test_array_elements_whole_or_one_character_at_a_time(text, elements):
    assert ArrayElements().feed(text) == elements
    scanner = ArrayElements()
    assert [element for char in text for element in scanner.feed(char)] == elements


# The real model (SmolLM2-135M, greedy), in process, through the openai SDK. Forced to search, it repeats one call.
SEARCH = {
    "type": "function",
    "name": "search",
    "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
}
CHAT_SEARCH = {"type": "function", "function": {k: v for k, v in SEARCH.items() if k != "type"}}
LOOPING = "Who won the world cup in 2018?"
BUDGET = 80  # about two and a half of its calls


@pytest.fixture(scope="module")
def sdk(smollm2_dir, tmp_path_factory):
    from hybridserve.engine.async_llm import AsyncLLM
    from hybridserve.engine.client import InprocEngineClient
    from hybridserve.engine.llm import LLM

    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", kv_cache_prefault=False)
    model = AsyncLLM(InprocEngineClient(llm.core, llm.config), llm.tokenizer, "smollm2", llm.eos_token_ids, smollm2_dir)
    with TestClient(build_app(model, None, tmp_path_factory.mktemp("data"))) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=http)


def search_calls(calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    assert all(name == "search" and isinstance(json.loads(arguments)["query"], str) for name, arguments in calls)
    return calls


def responses_sdk(sdk, **kw):
    return sdk.responses.create(
        model="smollm2", input=LOOPING, tools=[SEARCH], tool_choice="required", temperature=0, **kw
    )


def chat_sdk(sdk, **kw):
    return sdk.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": LOOPING}],
        tools=[CHAT_SEARCH],
        tool_choice="required",
        temperature=0,
        **kw,
    )


def test_a_looping_model_cut_short_on_responses(sdk):
    r = responses_sdk(sdk, max_output_tokens=BUDGET)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert all(item.type == "function_call" and item.status == "completed" for item in r.output)
    calls = search_calls([(item.name, item.arguments) for item in r.output])
    assert len(calls) >= 2  # it repeats its call: every complete one is a call, the cut one is gone

    evs = list(responses_sdk(sdk, max_output_tokens=BUDGET, stream=True))
    body = ["response.created", "response.in_progress", *CALL_EVENTS * len(calls), "response.incomplete"]
    assert [e.type for e in evs] == body
    final = evs[-1].response
    assert [(item.name, item.arguments) for item in final.output] == calls
    assert [e.delta for e in evs if e.type == "response.function_call_arguments.delta"] == [a for _, a in calls]


def test_a_looping_model_cut_short_on_chat(sdk):
    [choice] = chat_sdk(sdk, max_tokens=BUDGET).choices
    assert (choice.finish_reason, choice.message.content) == ("length", None)
    calls = search_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
    assert len(calls) >= 2

    chunks = list(chat_sdk(sdk, max_tokens=BUDGET, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    streamed = [call for delta in deltas for call in delta.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == [
        (k, name, arguments) for k, (name, arguments) in enumerate(calls)
    ]
    assert all(not delta.content for delta in deltas)  # no JSON as text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_cap_ends_a_looping_turn(sdk, monkeypatch):
    """With the cap at 2 the grammar ends the list after two calls, long before the budget (without the cap
    the loop would run to it: "length")."""
    monkeypatch.setattr(tools, "MAX_FORCED_CALLS", 2)
    r = responses_sdk(sdk, max_output_tokens=4 * BUDGET)
    calls = search_calls([(item.name, item.arguments) for item in r.output])
    assert (r.status, len(calls)) == ("completed", 2)
    [choice] = chat_sdk(sdk, max_tokens=4 * BUDGET).choices
    calls = search_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
    assert (choice.finish_reason, len(calls)) == ("tool_calls", 2)
