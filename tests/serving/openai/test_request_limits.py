"""What requests may ask for (issue 14, item 7): OpenAI's ranges for n and the sampling numbers, finite numbers,
JSON's own types, valid function schemas, and known tool types and `include` values, on every endpoint."""

import json
import re
from typing import get_args

import pytest

from hybridserve.serving.openai.prompt import max_token_bytes
from hybridserve.serving.openai.responses.protocol import Includable
from hybridserve.serving.openai.tools import CHAT_TOOL_TYPES, RESPONSES_TOOL_TYPES
from tests.serving.helpers import QUESTION, assert_error

CHAT = "/v1/chat/completions"
ENDPOINTS = {
    CHAT: {"messages": QUESTION},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
}
SAMPLING = [CHAT, "/v1/completions"]  # n and the penalties; Responses takes temperature and top_p only
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def raw_post(client, path: str, body: str):
    return client.post(path, content=body.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", SAMPLING)
def test_n_is_at_most_128(client, engine, path):
    r = client.post(path, json={**ENDPOINTS[path], "n": 1000})
    assert_error(r, 400, "n must be in [1, 128], got 1000", "n", "invalid_value")
    assert client.post(path, json={**ENDPOINTS[path], "n": 128, "max_tokens": 1}).status_code == 200
    assert len(engine.calls) == 128  # one engine request per choice


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"temperature": 1e308}, "temperature must be in [0, 2], got 1e+308", "temperature"),
        ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5", "temperature"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5", "top_p"),
    ],
)
def test_sampling_numbers_in_openai_ranges(client, engine, path, fields, message, param):
    max_tokens = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    assert_error(client.post(path, json={**ENDPOINTS[path], **fields}), 400, message, param, "invalid_value")
    assert client.post(path, json={**ENDPOINTS[path], "temperature": 2, max_tokens: 1}).status_code == 200
    assert len(engine.calls) == 1


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize(("literal", "shown"), [("Infinity", "Infinity"), ("-Infinity", "-Infinity"), ("NaN", "NaN")])
def test_numbers_must_be_finite(client, engine, path, literal, shown):
    start = json.dumps(ENDPOINTS[path])[:-1]
    for field in ("temperature", "top_p"):
        r = raw_post(client, path, f'{start}, "{field}": {literal}}}')
        assert_error(
            r,
            400,
            f"Invalid value for '{field}': Input should be a finite number, got {shown}.",
            field,
            "invalid_value",
        )
    assert engine.calls == []


@pytest.mark.parametrize("path", SAMPLING)
def test_penalties_must_be_finite(client, engine, path):
    start = json.dumps(ENDPOINTS[path])[:-1]
    for field in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        r = raw_post(client, path, f'{start}, "{field}": 1e999}}')  # overflows to infinity
        message = f"Invalid value for '{field}': Input should be a finite number, got Infinity."
        assert_error(r, 400, message, field, "invalid_value")
    r = client.post(path, json={**ENDPOINTS[path], "frequency_penalty": -2.5})
    assert_error(r, 400, "frequency_penalty must be in [-2, 2], got -2.5", "frequency_penalty", "invalid_value")
    assert engine.calls == []


@pytest.mark.parametrize(
    ("path", "fields", "message", "param"),
    [
        (CHAT, {"stream": "yes"}, 'Input should be a valid boolean, got "yes"', "stream"),
        (CHAT, {"temperature": False}, "Input should be a valid number, got false", "temperature"),
        (CHAT, {"n": "2"}, 'Input should be a valid integer, got "2"', "n"),
        (CHAT, {"logprobs": 1}, "Input should be a valid boolean, got 1", "logprobs"),
        (CHAT, {"max_tokens": 5.0}, "Input should be a valid integer, got 5.0", "max_tokens"),
        (
            CHAT,
            {"stream": True, "stream_options": {"include_usage": "true"}},
            'Input should be a valid boolean, got "true"',
            "stream_options.include_usage",
        ),
        ("/v1/completions", {"echo": "false"}, 'Input should be a valid boolean, got "false"', "echo"),
        ("/v1/completions", {"prompt": [1, 2.0]}, "Input should be a valid string, got [1, 2.0]", "prompt"),
        ("/v1/responses", {"store": "no"}, 'Input should be a valid boolean, got "no"', "store"),
        ("/v1/responses", {"top_p": True}, "Input should be a valid number, got true", "top_p"),
    ],
)
def test_json_types_are_taken_as_sent(client, engine, path, fields, message, param):
    r = client.post(path, json={**ENDPOINTS[path], **fields})
    assert_error(r, 400, f"Invalid value for '{param}': {message}.", param, "invalid_type")
    assert engine.calls == []


def chat_tool(parameters):
    return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}


def responses_tool(parameters):
    return {"type": "function", "name": "get_weather", "parameters": parameters}


@pytest.mark.parametrize(
    ("parameters", "problem"),
    [
        (
            {"type": "object", "properties": {"city": {"type": "strin"}}},
            "In context=('properties', 'city', 'type'), 'strin' is not valid under any of the given schemas.",
        ),
        ({"type": "object", "required": "city"}, "In context=('required',), 'city' is not of type 'array'."),
        (
            {"type": "object", "properties": {"city": {"type": "string", "pattern": "("}}},
            "In context=('properties', 'city', 'pattern'), '(' is not a 'regex'.",
        ),
    ],
)
@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_function_schemas_are_checked_unforced_too(client, engine, parameters, problem, tool_choice):
    message = f"Invalid schema for function 'get_weather': {problem}"
    r = client.post(CHAT, json={"messages": QUESTION, "tools": [chat_tool(parameters)], "tool_choice": tool_choice})
    assert_error(r, 400, message, "tools[0].function.parameters", "invalid_function_parameters")
    r = client.post(
        "/v1/responses", json={"input": "hi", "tools": [responses_tool(parameters)], "tool_choice": tool_choice}
    )
    assert_error(r, 400, message, "tools[0].parameters", "invalid_function_parameters")
    assert engine.calls == []


def test_valid_function_schemas_are_served(client, engine):
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **WEATHER}
    for parameters in (WEATHER, draft7, {}):
        assert client.post(CHAT, json={"messages": QUESTION, "tools": [chat_tool(parameters)]}).status_code == 200
        assert (
            client.post("/v1/responses", json={"input": "hi", "tools": [responses_tool(parameters)]}).status_code == 200
        )
    assert len(engine.calls) == 6


def supported(types) -> str:
    return ", ".join(repr(t) for t in types)


@pytest.mark.parametrize(
    ("path", "tool", "message", "code"),
    [
        (
            CHAT,
            {"type": "web_search"},
            f"Invalid value for 'tools[0].type': 'web_search'. Supported values are: {supported(CHAT_TOOL_TYPES)}.",
            "invalid_value",
        ),
        (
            CHAT,
            {"function": {"name": "get_weather", "parameters": WEATHER}},
            "Missing required parameter: 'tools[0].type'.",
            "missing_required_parameter",
        ),
        (
            "/v1/responses",
            {"type": "fucntion", "name": "get_weather"},
            f"Invalid value for 'tools[0].type': 'fucntion'. Supported values are: {supported(RESPONSES_TOOL_TYPES)}.",
            "invalid_value",
        ),
    ],
)
def test_unknown_tool_types_are_400(client, engine, path, tool, message, code):
    r = client.post(path, json={**ENDPOINTS[path], "tools": [tool]})
    assert_error(r, 400, message, "tools[0].type", code)
    assert engine.calls == []


def test_other_openai_tool_types_are_ignored_on_chat_too(client, engine):
    custom = {"type": "custom", "custom": {"name": "apply_patch", "description": "Edits files."}}
    r = client.post(CHAT, json={"messages": QUESTION, "tools": [custom]})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."


def test_include_values(client, engine):
    known = ["reasoning.encrypted_content", "web_search_call.results", "message.output_text.logprobs"]
    body = client.post("/v1/responses", json={"input": "hi", "include": known, "max_output_tokens": 1}).json()
    assert engine.calls[0][1].logprobs == 0
    assert body["output"][0]["content"][0]["logprobs"]
    r = client.post("/v1/responses", json={"input": "hi", "include": ["reasoning.encrypted_content", "everything"]})
    values = [repr(v) for v in get_args(Includable)]
    expected = "Input should be " + ", ".join(values[:-1]) + f" or {values[-1]}"
    assert_error(
        r, 400, f"Invalid value for 'include[1]': {expected}, got \"everything\".", "include[1]", "invalid_value"
    )
    assert len(engine.calls) == 1


@pytest.mark.parametrize("path", [CHAT, "/v1/responses"])
def test_a_prompt_whose_bytes_prove_it_too_long_is_refused_before_it_is_tokenized(
    client, engine, tokenizer, monkeypatch, path
):
    """A tool with a 20,000-value enum renders to ~400 kB: more tokens than the context holds whatever the text,
    since no token spans more than max_token_bytes. It is refused from its size, never tokenized."""
    encoded: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or encode(text, **kw))
    huge = {"type": "object", "properties": {"id": {"enum": [f"value-{i:05d}" for i in range(20_000)]}}}
    tool = {"type": "function", "function": {"name": "pick", "parameters": huge}}
    if path != CHAT:
        tool = {"type": "function", "name": "pick", "parameters": huge}
    r = client.post(path, json={**ENDPOINTS[path], "tools": [tool]})
    what = "messages" if path == CHAT else "input"
    most = max_token_bytes(tokenizer)
    assert most is not None and r.status_code == 400, r.json()
    shown = re.search(r"your \w+ is (\d+) bytes", r.json()["error"]["message"])
    assert shown is not None, r.json()
    size = int(shown.group(1))
    assert size > 256 * most  # the fake engine's context
    message = (
        f"This model's maximum context length is 256 tokens. However, your {what} is {size} bytes once rendered, "
        f"at least {-(-size // most)} tokens (no token spans more than {most} bytes), which leaves no room for the "
        f"completion. Please reduce the length of the {what}."
    )
    assert_error(r, 400, message, what, "context_length_exceeded")
    assert all(n < 1000 for n in encoded) and not engine.calls  # only small strings were tokenized


def test_a_completion_prompt_whose_bytes_prove_it_too_long_is_refused_before_it_is_tokenized(
    client, engine, tokenizer, monkeypatch
):
    encoded: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or encode(text, **kw))
    most = max_token_bytes(tokenizer)
    assert most is not None
    text = "word " * (256 * most // 5 + 1)
    r = client.post("/v1/completions", json={"prompt": text})
    message = (
        f"This model's maximum context length is 256 tokens. However, your prompt is {len(text)} bytes, at least "
        f"{-(-len(text) // most)} tokens (no token spans more than {most} bytes), which leaves no room for the "
        "completion. Please reduce the length of the prompt."
    )
    assert_error(r, 400, message, "prompt", "context_length_exceeded")
    r = client.post("/v1/completions", json={"prompt": ["hi", text]})
    assert r.json()["error"]["param"] == "prompt[1]"
    assert encoded == [] and not engine.calls
