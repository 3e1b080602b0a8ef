"""Messages API requests as the chat path serves them: conversation and tool mapping (the same prompt as the
equivalent chat request), thinking signatures, errors in Anthropic's shape, auth, failures, metrics."""

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.anthropic.convert import chat_request
from hybridserve.serving.anthropic.protocol import MessagesRequest
from hybridserve.serving.anthropic.signature import ThinkingSigner
from hybridserve.serving.app import build_app
from hybridserve.serving.parsers import Parsers
from tests.serving.anthropic.helpers import QUESTION, TOOLS, body, error, events, script
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, call_until_disconnect

NO = {"type": "text", "text": "No"}
SPEC = TOOLS[0]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": SPEC["description"], "parameters": SPEC["input_schema"]},
    }
]


def test_a_tool_conversation_renders_as_its_chat_equivalent(client, engine, signer):
    """thinking, text, tool_use, tool_result (one an error) and text: the prompt the chat endpoint makes of the
    same conversation in its own shape."""
    anthropic_messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need data.", "signature": signer.sign("Need data.")},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Lyon"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [NO], "is_error": True},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    call2 = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        *QUESTION,
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Need data.",
            "tool_calls": [{"id": "toolu_1", **call}, {"id": "toolu_2", **call2}],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: No"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    r = client.post("/v1/messages", json=body(system="Be brief.", messages=anthropic_messages, tools=TOOLS))
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": chat_messages, "tools": CHAT_TOOLS, "max_tokens": 100})
    assert r.status_code == 200, r.text
    assert engine.calls[0][0] == engine.calls[1][0]
    assert "Sunny" in engine.tokenizer.decode(engine.calls[0][0])


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, ("auto", None)),
        ({"type": "any"}, ("required", None)),
        ({"type": "none"}, ("none", None)),
        ({"type": "tool", "name": "get_weather"}, ({"type": "function", "function": {"name": "get_weather"}}, None)),
        ({"type": "any", "disable_parallel_tool_use": True}, ("required", False)),
        ({"type": "auto", "disable_parallel_tool_use": False}, ("auto", True)),
    ],
)
def test_tool_choice_maps_to_chats(choice, expected):
    chat = chat_request(MessagesRequest.model_validate(body(tools=TOOLS, tool_choice=choice)), ThinkingSigner())
    assert (chat.tool_choice, chat.parallel_tool_calls) == expected
    assert chat.tools == CHAT_TOOLS


@pytest.mark.parametrize(
    ("fields", "thinking", "effort"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, {"type": "enabled"}, "low"),
        ({"thinking": {"type": "enabled", "budget_tokens": 8000}}, {"type": "enabled"}, "medium"),
        ({"thinking": {"type": "enabled", "budget_tokens": 32000}}, {"type": "enabled"}, "high"),
        ({"thinking": {"type": "adaptive"}}, {"type": "enabled"}, None),
        ({"thinking": {"type": "disabled"}}, {"type": "disabled"}, None),
        ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}}, {"type": "enabled"}, "max"),
        ({}, None, None),
    ],
)
def test_thinking_maps_to_chats_reasoning_fields(fields, thinking, effort):
    chat = chat_request(MessagesRequest.model_validate(body(**fields)), ThinkingSigner())
    assert (chat.thinking, chat.reasoning_effort) == (thinking, effort)


def test_forced_tool_reaches_the_grammar(client, engine, tokenizer):
    engine.scripts = [script(tokenizer, '{"city": "Paris"}')]
    message = client.post("/v1/messages", json=body(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}))
    assert engine.calls[0][1].structured_output is not None
    [block] = message.json()["content"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", {"city": "Paris"})
    assert message.json()["stop_reason"] == "tool_use"


def test_thinking_signature_round_trip(client, engine, tokenizer):
    engine.scripts = [script(tokenizer, "<think>Need data.</think>Paris.")]
    first = client.post("/v1/messages", json=body()).json()
    history = [*QUESTION, {"role": "assistant", "content": first["content"]}, {"role": "user", "content": "Sure?"}]
    assert client.post("/v1/messages", json=body(messages=history)).status_code == 200
    altered = json.loads(json.dumps(history))
    altered[1]["content"][0]["thinking"] = "Need no data."
    r = client.post("/v1/messages", json=body(messages=altered))
    assert (r.status_code, r.json()) == (
        400,
        error(
            "invalid_request_error",
            "messages[1].content[0]: invalid signature for this thinking block; thinking blocks must be sent back "
            "unchanged, as this server sent them.",
        ),
    )
    forged = [*QUESTION, {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "x"}]}]
    assert client.post("/v1/messages", json=body(messages=forged)).status_code == 400
    other_server = ThinkingSigner()
    forged[1]["content"][0]["signature"] = other_server.sign("x")
    assert client.post("/v1/messages", json=body(messages=forged)).status_code == 400
    assert len(engine.calls) == 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": "100"}, "Invalid value for 'max_tokens': Input should be a valid integer, got \"100\"."),
        ({"max_tokens": None}, "Invalid value for 'max_tokens': Input should be a valid integer, got null."),
        ({"max_tokens": 0}, "max_tokens: must be at least 1, got 0."),
        ({"stream": "yes"}, "Invalid value for 'stream': Input should be a valid boolean, got \"yes\"."),
        ({"temperature": "hot"}, "Invalid value for 'temperature': Input should be a valid number, got \"hot\"."),
        ({"system": 5}, "Invalid value for 'system': Input should be a valid array, got 5."),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "Invalid value for 'messages[0].content': Input should be a valid array, got 5.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "Invalid value for 'messages[0].content[0].text': Input should be a valid string, got 5.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]: content blocks of type 'image' are not supported by this server.",
        ),
        ({"messages": []}, "messages: at least one message is required."),
        (
            {"thinking": {"type": "sometimes"}},
            "Invalid value for 'thinking.type': Input should be 'enabled', 'disabled' or 'adaptive', "
            'got "sometimes".',
        ),
        ({"thinking": {"type": "enabled"}}, "Missing required parameter: 'thinking.budget_tokens'."),
        (
            {"tools": [{"name": "get_weather", "input_schema": {"type": 5}}]},
            "Invalid schema for function 'get_weather': In context=('type',), 5 is not valid under any of the given "
            "schemas.",
        ),
        ({"tools": [{"name": "get_weather"}]}, "Missing required parameter: 'tools[0].input_schema'."),
        (
            {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
            "tool_choice names function 'nope', which is not in tools.",
        ),
    ],
)
def test_bad_requests_are_400s_in_anthropics_shape(client, engine, fields, message):
    r = client.post("/v1/messages", json=body(**fields))
    assert (r.status_code, r.json()) == (400, error("invalid_request_error", message))
    assert engine.calls == []


def test_missing_fields_and_malformed_json(client):
    r = client.post("/v1/messages", json={"model": "smollm2", "messages": QUESTION})
    assert (r.status_code, r.json()) == (
        400,
        error("invalid_request_error", "Missing required parameter: 'max_tokens'."),
    )
    r = client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_a_404(client):
    r = client.post("/v1/messages", json=body(model="claude-sonnet-4-5"))
    assert (r.status_code, r.json()) == (
        404,
        error("not_found_error", "The model `claude-sonnet-4-5` does not exist."),
    )


def test_server_tools_are_accepted_and_not_served(client, engine):
    server_tool = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    assert client.post("/v1/messages", json=body(tools=[server_tool, *TOOLS])).status_code == 200
    assert "get_weather" in engine.tokenizer.decode(engine.calls[0][0])
    assert "web_search" not in engine.tokenizer.decode(engine.calls[0][0])


def test_api_key_as_x_api_key_or_bearer(tokenizer):
    engine = FakeEngine(tokenizer, [PARIS])
    with TestClient(build_app(engine, "sk-test")) as client:
        r = client.post("/v1/messages", json=body())
        assert (r.status_code, r.json()) == (
            401,
            error("authentication_error", "Missing API key: send it as 'x-api-key: <key>'."),
        )
        r = client.post("/v1/messages", json=body(), headers={"x-api-key": "wrong"})
        assert (r.status_code, r.json()) == (401, error("authentication_error", "Incorrect API key provided."))
        assert client.post("/v1/messages", json=body(), headers={"x-api-key": "sk-test"}).status_code == 200
        assert client.post("/v1/messages", json=body(), headers={"authorization": "Bearer sk-test"}).status_code == 200
        chat = {"messages": QUESTION}
        assert client.post("/v1/chat/completions", json=chat, headers={"x-api-key": "sk-test"}).status_code == 200


def test_a_failure_mid_stream_is_an_error_event(client, engine):
    engine.error_at_step = 2
    evs = events(client.post("/v1/messages", json=body(stream=True)).text)
    assert [e["type"] for e in evs] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "error",
    ]
    assert evs[-1] == error("api_error", "CUDA error")
    r = client.post("/v1/messages", json=body())
    assert (r.status_code, r.json()) == (500, error("api_error", "CUDA error"))


def test_an_unavailable_engine_is_overloaded(client, engine):
    from hybridserve.engine.protocol import EngineUnavailable

    engine.reject = EngineUnavailable("no engine worker is up")
    r = client.post("/v1/messages", json=body())
    assert (r.status_code, r.json()) == (529, error("overloaded_error", "no engine worker is up"))


def test_requests_are_counted_in_the_metrics(client):
    assert client.post("/v1/messages", json=body()).status_code == 200
    assert client.post("/v1/messages", json=body(max_tokens=2, stream=True)).status_code == 200
    text = client.get("/metrics").text
    assert 'outcome="stop"} 1.0' in text and 'outcome="length"} 1.0' in text
    assert "hybridserve:generation_tokens_total" in text


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_aborts_its_request(tokenizer, stream):
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 3

    async def main():
        return await call_until_disconnect(build_app(engine, None), "/v1/messages", body(stream=stream), engine.paused)

    sent = asyncio.run(main())
    assert engine.aborted == [engine.calls[0][2]] and engine.completed == [] and engine.running == 0
    sent_body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert sent[0]["status"] == (200 if stream else 499)
    assert b"message_stop" not in sent_body


def test_call_arguments_that_are_no_object_are_sent_as_an_empty_input(client, engine, tokenizer, caplog):
    engine.scripts = [script(tokenizer, '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>')]
    message = client.post("/v1/messages", json=body(tools=TOOLS)).json()
    [block] = message["content"]
    assert (block["type"], block["input"], message["stop_reason"]) == ("tool_use", {}, "tool_use")
    assert "arguments are not a JSON object" in caplog.text


def test_the_signature_secret_outlives_a_restart_in_the_data_dir(tokenizer, tmp_path):
    """A conversation with thinking blocks goes on after the server restarts on the same data directory."""

    def server(data_dir=None):  # an engine per server: each runs on its own event loop
        engine = FakeEngine(tokenizer, [script(tokenizer, "<think>Need data.</think>Paris.")])
        return TestClient(build_app(engine, None, data_dir=data_dir, parsers=Parsers("think", "hermes")))

    with server(tmp_path) as client:
        first = client.post("/v1/messages", json=body()).json()
    assert (tmp_path / "thinking-signature.key").stat().st_mode & 0o777 == 0o600
    history = [*QUESTION, {"role": "assistant", "content": first["content"]}, {"role": "user", "content": "Sure?"}]
    with server(tmp_path) as client:
        assert client.post("/v1/messages", json=body(messages=history)).status_code == 200
    with server() as client:  # no data directory: a secret of its own
        assert client.post("/v1/messages", json=body(messages=history)).status_code == 400
    (tmp_path / "thinking-signature.key").write_bytes(b"short")
    with pytest.raises(ValueError, match="holds no thinking-signature secret"):
        server(tmp_path)
