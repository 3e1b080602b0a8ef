"""POST /v1/messages against the scripted engine: exact bodies, exact event streams, stop reasons, budgets."""

import re

from tests.serving.anthropic.helpers import CALL, MODEL, QUESTION, TOOLS, body, events, script
from tests.serving.helpers import PARIS_PIECES, chat_prompt

TEXT = "The capital of France is Paris."
USAGE = {"input_tokens": 37, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def test_non_stream_body_is_exact(client, engine, tokenizer):
    r = client.post("/v1/messages", json=body(), headers={"anthropic-version": "2023-06-01"})
    assert (r.status_code, r.headers["content-type"]) == (200, "application/json")
    message = r.json()
    assert re.fullmatch(r"msg_[0-9a-f]{32}", message["id"])
    assert message == {
        "id": message["id"],
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": TEXT}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {**USAGE, "output_tokens": 8},
    }
    [(prompt, params, request_id)] = engine.calls
    assert prompt == chat_prompt(tokenizer, QUESTION) and request_id == message["id"]
    assert params.max_tokens == 100
    assert engine.completed == [message["id"]]


def test_stream_text_events_are_exact(client):
    r = client.post("/v1/messages", json=body(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    head = evs[0]["message"]
    assert re.fullmatch(r"msg_[0-9a-f]{32}", head["id"])
    assert evs == [
        {
            "type": "message_start",
            "message": {
                "id": head["id"],
                "type": "message",
                "role": "assistant",
                "model": MODEL,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {**USAGE, "output_tokens": 0},
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        *(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
            for piece in PARIS_PIECES
        ),
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {**USAGE, "output_tokens": 8},
        },
        {"type": "message_stop"},
    ]


def _squeezed(evs: list[dict]) -> list[tuple]:
    """The events with each block's run of deltas of one type joined: (type, index, joined text) for deltas."""
    out: list[tuple] = []
    for e in evs:
        if e["type"] != "content_block_delta":
            out.append((e["type"], e.get("index"), e.get("content_block") or e.get("delta")))
            continue
        delta = dict(e["delta"])
        kind = delta.pop("type")
        [text] = delta.values()
        if out and out[-1][:2] == (kind, e["index"]):
            out[-1] = (kind, e["index"], out[-1][2] + text)
        else:
            out.append((kind, e["index"], text))
    return out


def test_stream_thinking_then_text(client, engine, tokenizer, signer):
    engine.scripts = [script(tokenizer, "<think>The user asks a capital.</think>Paris.")]
    evs = events(client.post("/v1/messages", json=body(stream=True)).text)
    thinking = "The user asks a capital."
    assert _squeezed(evs)[1:] == [
        ("content_block_start", 0, {"type": "thinking", "thinking": "", "signature": ""}),
        ("thinking_delta", 0, thinking),
        ("signature_delta", 0, signer.sign(thinking)),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "text", "text": ""}),
        ("text_delta", 1, "Paris."),
        ("content_block_stop", 1, None),
        ("message_delta", None, {"stop_reason": "end_turn", "stop_sequence": None}),
        ("message_stop", None, None),
    ]


def test_stream_tool_use(client, engine, tokenizer):
    engine.scripts = [script(tokenizer, "Let me check." + CALL)]
    evs = events(client.post("/v1/messages", json=body(stream=True, tools=TOOLS)).text)
    squeezed = _squeezed(evs)
    tool = squeezed[4][2]
    assert re.fullmatch(r"toolu_[0-9a-f]{32}", tool["id"])
    assert squeezed[1:] == [
        ("content_block_start", 0, {"type": "text", "text": ""}),
        ("text_delta", 0, "Let me check."),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "tool_use", "id": tool["id"], "name": "get_weather", "input": {}}),
        ("input_json_delta", 1, '{"city": "Paris"}'),
        ("content_block_stop", 1, None),
        ("message_delta", None, {"stop_reason": "tool_use", "stop_sequence": None}),
        ("message_stop", None, None),
    ]


def test_non_stream_thinking_text_and_tool_use(client, engine, tokenizer, signer):
    engine.scripts = [script(tokenizer, "<think>Need data.</think>Checking." + CALL)]
    message = client.post("/v1/messages", json=body(tools=TOOLS, thinking={"type": "adaptive"})).json()
    call_id = message["content"][2]["id"]
    assert message["content"] == [
        {"type": "thinking", "thinking": "Need data.", "signature": signer.sign("Need data.")},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert (message["stop_reason"], message["stop_sequence"]) == ("tool_use", None)


def test_stop_sequence(client, engine):
    message = client.post("/v1/messages", json=body(stop_sequences=["France", "Paris"])).json()
    assert message["content"] == [{"type": "text", "text": "The capital of "}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "France")
    assert engine.calls[0][1].stop == ("France", "Paris")
    evs = events(client.post("/v1/messages", json=body(stop_sequences=["Paris"], stream=True)).text)
    assert evs[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "Paris"}


def test_max_tokens_ends_the_turn(client):
    message = client.post("/v1/messages", json=body(max_tokens=3)).json()
    assert message["content"] == [{"type": "text", "text": "The capital of"}]
    assert (message["stop_reason"], message["stop_sequence"], message["usage"]["output_tokens"]) == (
        "max_tokens",
        None,
        3,
    )


def test_max_tokens_past_the_context_is_clamped(client, engine):
    r = client.post("/v1/messages", json=body(max_tokens=200_000))
    assert r.status_code == 200, r.text
    assert engine.calls[0][1].max_tokens == engine.max_model_len - 37


def test_unknown_fields_are_ignored(client, engine, tokenizer):
    r = client.post(
        "/v1/messages",
        json=body(
            system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "x"}}]}],
            metadata={"user_id": "u1"},
            context_management={"edits": []},
            output_config={"effort": "low"},
            service_tier="auto",
            container=None,
            mcp_servers=[],
            some_future_field={"anything": [1, 2]},
            temperature=0.5,
            top_p=0.9,
            top_k=40,
        ),
    )
    assert r.status_code == 200, r.text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    [(prompt, params, _)] = engine.calls
    assert prompt == chat_prompt(tokenizer, messages)
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 0.9, 40)


def test_system_role_messages_join_the_system_text(client, engine, tokenizer):
    sent = [{"role": "system", "content": "Use French."}, *QUESTION]
    assert client.post("/v1/messages", json=body(system="Be brief.", messages=sent)).status_code == 200
    system = {"role": "system", "content": "Be brief.\nUse French."}
    assert engine.calls[0][0] == chat_prompt(tokenizer, [system, *QUESTION])


def test_count_tokens_is_the_prompt_the_engine_gets(client, engine):
    request = body(system="Be brief.", tools=TOOLS, thinking={"type": "enabled", "budget_tokens": 2048})
    counted = client.post("/v1/messages/count_tokens", json={k: v for k, v in request.items() if k != "max_tokens"})
    assert counted.status_code == 200 and set(counted.json()) == {"input_tokens"}
    assert engine.calls == []
    assert client.post("/v1/messages", json=request).status_code == 200
    assert counted.json()["input_tokens"] == len(engine.calls[0][0]) > 100  # the tools are in the prompt
