"""Structured output through the API: what reaches the engine, what the client gets back, and bad schemas."""

import json

from hybridserve.sampling_params import StructuredOutput
from hybridserve.serving.openai.tools import MAX_FORCED_CALLS
from tests.serving.helpers import error_body
from tests.serving.openai.responses.test_responses import ASK
from tests.serving.openai.test_tools import ARGS, CHAT_TOOLS, TOOLS, script
from tests.serving.openapi_schema import check

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CITY = '{"city": "Paris"}'


def sent_constraint(engine) -> StructuredOutput | None:
    return engine.calls[-1][1].structured_output


def test_responses_json_schema(client, engine, tokenizer):
    engine.scripts = [script(tokenizer, CITY)]
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    body = client.post("/v1/responses", json={"input": ASK, "text": {"format": fmt}}).json()
    check(body, "Response")
    assert body["text"] == {"format": fmt}
    assert body["output"][0]["content"][0]["text"] == CITY
    assert sent_constraint(engine) == StructuredOutput(json_schema=json.dumps(SCHEMA))


def test_responses_json_object_and_text(client, engine):
    client.post("/v1/responses", json={"input": ASK, "text": {"format": {"type": "json_object"}}})
    assert sent_constraint(engine) == StructuredOutput(json_object=True)
    client.post("/v1/responses", json={"input": ASK, "text": {"format": {"type": "text"}}})
    assert sent_constraint(engine) is None


def test_chat_response_format(client, engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "response_format": fmt})
    assert sent_constraint(engine) == StructuredOutput(json_schema=json.dumps(SCHEMA))


def test_forced_calls_are_constrained_and_read_as_json(client, engine, tokenizer):
    engine.scripts = [script(tokenizer, f'[{{"name": "get_weather", "arguments": {ARGS}}}]')]
    body = client.post("/v1/responses", json={"input": ASK, "tools": TOOLS, "tool_choice": "required"}).json()
    [call] = body["output"]
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "get_weather", ARGS)
    forced = json.loads(sent_constraint(engine).json_schema)
    assert (forced["type"], forced["minItems"], forced["maxItems"]) == ("array", 1, MAX_FORCED_CALLS)
    assert forced["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}

    engine.scripts = [script(tokenizer, ARGS)]
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "tools": CHAT_TOOLS, "tool_choice": named},
    ).json()
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(sent_constraint(engine).json_schema) == TOOLS[0]["parameters"]


def test_bad_formats_are_400s_before_any_engine_work(client, engine):
    cases = [
        (
            {"input": ASK, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format.schema",
        ),
        ({"input": ASK, "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": ASK, "text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format.name"),
    ]
    for body, param in cases:
        r = client.post("/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
    )
    assert (r.status_code, r.json()) == (
        400,
        error_body(
            "Missing required parameter: 'response_format.json_schema.name'.", param="response_format.json_schema.name"
        ),
    )
    assert engine.calls == []
