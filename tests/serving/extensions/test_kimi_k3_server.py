"""A kimi_k3 server over the scripted engine with the K3 test tokenizer: what the engine receives (read back
through return_token_ids) and what the client gets, on Responses and Chat, against a model without one."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hybridserve.config import ExtensionConfig
from hybridserve.rendering.kimi_k3 import ASSISTANT_OPEN, RESPONSE_OPEN, THINK_OPEN, render_calls
from hybridserve.serving.app import build_app
from hybridserve.serving.extensions import extension_for
from scripts.make_tiny_checkpoints import k3_tokenizer
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS
from tests.serving.openai.responses.test_responses import events

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
THOUGHT_THEN_HI = "hm<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|><|close|>message<|sep|>"
HI = "Hi<|close|>response<|sep|><|close|>message<|sep|>"


@pytest.fixture(scope="module")
def k3_tok():
    return k3_tokenizer()


def script(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def k3_engine(tok) -> FakeEngine:
    """A scripted kimi_k3 engine that thinks, then says hi."""
    engine = FakeEngine(tok, [script(tok, THOUGHT_THEN_HI)], max_model_len=4096)
    engine.model_type = "kimi_k3"
    engine.eos_token_ids = [tok.eos_token_id]
    return engine


@pytest.fixture
def engine(k3_tok):
    return k3_engine(k3_tok)


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, None)) as client:
        yield client


def respond(client, **body) -> dict:
    r = client.post("/v1/responses", json={"input": "Hello", "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def rendered(engine, body: dict) -> str:
    assert engine.calls[-1][0] == body["prompt_token_ids"]  # the ids reported are the ids the engine got
    return engine.tokenizer.decode(body["prompt_token_ids"], skip_special_tokens=False)


@pytest.mark.parametrize(
    ("effort", "level"),
    [("minimal", "low"), ("low", "low"), ("medium", "high"), ("high", "high"), ("xhigh", "max"), ("max", "max")],
)
@pytest.mark.parametrize("stream", [False, True])
def test_effort_levels_reach_the_prompt_and_the_parser(client, engine, effort, level, stream):
    body = {"input": "Hello", "reasoning": {"effort": effort}, "return_token_ids": True, "stream": stream}
    r = client.post("/v1/responses", json=body)
    final = events(r.text)[-1]["response"] if stream else r.json()
    prompt = rendered(engine, final)
    assert f'type="thinking-effort"<|sep|>thinking_effort={level}<|close|>' in prompt
    assert prompt.endswith(ASSISTANT_OPEN + THINK_OPEN)
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "Hi"


@pytest.mark.parametrize("stream", [False, True])
def test_effort_none_turns_thinking_off(client, engine, k3_tok, stream):
    engine.scripts = [script(k3_tok, HI)]
    r = client.post(
        "/v1/responses",
        json={"input": "Hello", "reasoning": {"effort": "none"}, "return_token_ids": True, "stream": stream},
    )
    final = events(r.text)[-1]["response"] if stream else r.json()
    prompt = rendered(engine, final)
    assert prompt.endswith(ASSISTANT_OPEN + RESPONSE_OPEN) and "thinking-effort" not in prompt
    assert [item["type"] for item in final["output"]] == ["message"]
    assert final["output"][0]["content"][0]["text"] == "Hi"


def test_no_effort_keeps_the_default(client, engine):
    prompt = rendered(engine, respond(client))
    assert "thinking-effort" not in prompt and prompt.endswith(ASSISTANT_OPEN + THINK_OPEN)
    assert prompt.startswith('<|open|>message role="user"<|sep|>Hello')
    assert engine.calls[-1][1].skip_special_tokens is False  # the parsers see K3's markup


def test_tool_choice_required_is_enforced_by_the_prompt(client, engine, k3_tok):
    call = render_calls([{"id": "c", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}])
    engine.scripts = [script(k3_tok, "x<|close|>think<|sep|>" + call + "<|close|>message<|sep|>")]
    body = respond(client, tools=TOOLS, tool_choice="required")
    assert 'type="tool-choice"<|sep|>tool_choice=required' in rendered(engine, body)
    assert engine.calls[-1][1].structured_output is None  # no grammar: the template states it
    [_, item] = body["output"]
    assert (item["type"], item["name"], item["arguments"]) == ("function_call", "get_weather", '{"city": "Paris"}')


def test_tool_choice_none_keeps_tools_declared(client, engine):
    prompt = rendered(engine, respond(client, tools=TOOLS, tool_choice="none"))
    assert 'type="tool-declare"' in prompt and "tool_choice=none" in prompt


def test_tool_choice_without_tools(client, engine):
    assert "tool-choice" not in rendered(engine, respond(client, tool_choice="none"))
    assert client.post("/v1/responses", json={"input": "x", "tool_choice": "required"}).status_code == 400


def test_json_schema_goes_into_the_prompt_and_its_grammar_waits_for_the_response_channel(client, engine, k3_tok):
    fmt = {"type": "json_schema", "name": "a", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    prompt = rendered(engine, respond(client, text={"format": fmt}))
    assert '```json\n{"properties":{"a":{"type":"integer"}},"type":"object"}\n```' in prompt
    constraint = engine.calls[-1][1].structured_output  # thinking on: the think channel stays free ...
    assert constraint is not None and constraint.kind == "structural_tag"
    assert "<|close|>think<|sep|><|open|>response<|sep|>" in (constraint.structural_tag or "")  # ... until here
    engine.scripts = [script(k3_tok, '{"a": 1}<|close|>response<|sep|>')]
    respond(client, text={"format": fmt}, reasoning={"effort": "none"})
    assert engine.calls[-1][1].structured_output is not None  # thinking off: the response channel is open


def test_json_object_and_text(client, engine):
    assert 'type="response-format"<|sep|>json_object' in rendered(
        engine, respond(client, text={"format": {"type": "json_object"}})
    )
    assert "response-format" not in rendered(engine, respond(client, text={"format": {"type": "text"}}))


def test_explicit_kwargs_win(client, engine):
    body = respond(client, reasoning={"effort": "max"}, chat_template_kwargs={"thinking_effort": "low"})
    assert "thinking_effort=low" in rendered(engine, body)


def test_policy_pins_top_p_and_rejects_before_the_engine(client, engine):
    respond(client)
    assert engine.calls[-1][1].top_p == 1.0  # off by default
    extension = extension_for(engine.model_type, ExtensionConfig(kimi_param_policy=True))
    with TestClient(build_app(engine, None, extension=extension)) as policy_client:
        body = respond(policy_client)
        assert engine.calls[-1][1].top_p == 0.95 and body["top_p"] == 0.95
        calls = len(engine.calls)
        r = policy_client.post("/v1/responses", json={"input": "x", "temperature": 1.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = policy_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert len(engine.calls) == calls


SPLIT_AND_ORPHAN = [
    {"role": "user", "content": "Weather?"},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "part 1"},
    {"type": "function_call_output", "call_id": "gone", "output": "stray"},
    {"type": "function_call_output", "call_id": "c1", "output": "part 2"},
]


def test_split_and_orphan_results_on_the_k3_server(client, engine):
    prompt = rendered(engine, respond(client, input=SPLIT_AND_ORPHAN))
    assert (
        '<|open|>message role="tool" name="get_weather" index="1"<|sep|>part 1\npart 2'
        "<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="user"<|sep|>[Tool result for call gone, whose call is not in this conversation]\nstray'
    ) in prompt


def test_split_and_orphan_results_on_a_model_without_an_extension(tokenizer):
    engine = FakeEngine(tokenizer, [PARIS], max_model_len=1024)
    with TestClient(build_app(engine, None)) as client:
        body = client.post("/v1/responses", json={"input": SPLIT_AND_ORPHAN, "return_token_ids": True}).json()
    prompt = tokenizer.decode(body["prompt_token_ids"])
    assert prompt.count("<tool_response>") == 3 and "part 1\n</tool_response>" in prompt  # as sent, unmerged


def test_stored_turn_replays_text_not_reasoning(client, engine):
    first = respond(client)
    assert [item["type"] for item in first["output"]] == ["reasoning", "message"]
    prompt = rendered(engine, respond(client, input="And?", previous_response_id=first["id"]))
    assert '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|>' in prompt
    assert "hm" not in prompt


def test_chat_derivations_and_token_ids(client, engine):
    body = {
        "messages": [{"role": "user", "content": "Hello"}],
        "reasoning_effort": "xhigh",
        "response_format": {"type": "json_object"},
        "return_token_ids": True,
    }
    r = client.post("/v1/chat/completions", json=body).json()
    prompt = engine.tokenizer.decode(r["prompt_token_ids"], skip_special_tokens=False)
    assert "thinking_effort=max" in prompt and "json_object" in prompt
    choice = r["choices"][0]
    assert choice["message"]["reasoning_content"] == "hm" and choice["message"]["content"] == "Hi"
    assert choice["token_ids"] == engine.scripts[0]


def test_chat_rejects_bad_system_tools(client):
    messages = [{"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "1x"}}]}]
    r = client.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].tools[0].function.name"
