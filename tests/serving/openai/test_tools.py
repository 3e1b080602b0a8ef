"""Tool calls and reasoning through both endpoints, against the scripted engine: exact items, events, chunks."""

import json

import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from hybridserve.serving.parsers import Parsers
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import sse_payloads
from tests.serving.openai.responses.test_responses import events
from tests.serving.openapi_schema import check

EOS = 2
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ARGS = '{"city": "Paris"}'
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more of these functions to help with the user's request. "
    'Their signatures, one per line:\n<tools>\n{"name": "get_weather", "description": "Current weather in a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}\n'
    "</tools>\n\nTo call a function, write one block per call:\n"
    '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
)


def script(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + [EOS]


@pytest.fixture
def engine(tokenizer):
    return FakeEngine(tokenizer, [script(tokenizer, CALL)], max_model_len=1024)


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, None, parsers=Parsers("think", "hermes"))) as client:
        yield client


def prompt_text(engine, call: int = -1) -> str:
    return engine.tokenizer.decode(engine.calls[call][0])


def test_responses_function_call(client, engine):
    body = client.post("/v1/responses", json={"input": "Weather in Paris?", "tools": TOOLS}).json()
    check(body, "Response")
    [item] = body["output"]
    assert item == {
        "id": item["id"],
        "type": "function_call",
        "call_id": item["call_id"],
        "name": "get_weather",
        "arguments": ARGS,
        "status": "completed",
    }
    assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
    assert body["status"] == "completed" and body["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    # SmolLM2's template knows no tools: they reach the prompt in the Hermes form, as the system message
    assert prompt_text(engine) == (
        f"<|im_start|>system\n{TOOLS_BLOCK}<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_responses_stream_reasoning_text_and_call(client, engine, tokenizer):
    reasoning = "<think>The user wants weather.</think>"
    engine.scripts = [script(tokenizer, reasoning + "Let me check." + CALL)]
    evs = events(client.post("/v1/responses", json={"input": "Weather?", "tools": TOOLS, "stream": True}).text)
    kinds = [e["type"] for e in evs]
    n_reasoning = kinds.count("response.reasoning_text.delta")
    n_text = kinds.count("response.output_text.delta")
    assert n_reasoning > 1 and n_text > 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * n_reasoning,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n_text,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = evs[-1]["response"]
    rs, msg, fc = final["output"]
    assert rs == {
        "id": rs["id"],
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "The user wants weather."}],
        "status": "completed",
    }
    assert msg["content"][0]["text"] == "Let me check."
    assert (fc["name"], fc["arguments"]) == ("get_weather", ARGS)
    deltas = [e for e in evs if e["type"].endswith(".delta")]
    assert "".join(e["delta"] for e in deltas if "reasoning" in e["type"]) == "The user wants weather."
    indexes = [0] * (5 + n_reasoning) + [1] * (5 + n_text) + [2] * 4
    assert [e["output_index"] for e in evs if "output_index" in e] == indexes
    args_done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
    assert (args_done["item_id"], args_done["name"], args_done["arguments"]) == (fc["id"], "get_weather", ARGS)
    # reasoning tokens: every token up to and including the one that closes the block
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == len(
        tokenizer.encode(reasoning, add_special_tokens=False)
    )
    assert client.get(f"/v1/responses/{final['id']}").json() == final


def conversation_turns(client, engine, tokenizer, by_previous_id: bool) -> list[str]:
    """Three turns with a function call and its output, chained by previous_response_id or sent whole."""
    engine.scripts = [script(tokenizer, CALL)]
    first = client.post("/v1/responses", json={"input": "Weather in Paris?", "tools": TOOLS}).json()
    call = first["output"][0]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": '{"temp_c": 21}'}
    engine.scripts = [script(tokenizer, "It is 21 C in Paris.")]
    history = [{"role": "user", "content": "Weather in Paris?"}]
    codex_call = {"type": "function_call", "call_id": call["call_id"], "name": call["name"], "arguments": ARGS}
    if by_previous_id:
        second = client.post("/v1/responses", json={"input": [output], "previous_response_id": first["id"]})
    else:
        second = client.post("/v1/responses", json={"input": [*history, codex_call, output], "tools": TOOLS})
    second = second.json()
    assert second["output"][0]["content"][0]["text"] == "It is 21 C in Paris."
    if by_previous_id:
        third = {"input": "Thanks!", "previous_response_id": second["id"], "tools": TOOLS}
    else:
        answer = {"role": "assistant", "content": "It is 21 C in Paris."}
        third = {"input": [*history, codex_call, output, answer, {"role": "user", "content": "Thanks!"}]}
        third["tools"] = TOOLS
    client.post("/v1/responses", json=third)
    return [prompt_text(engine, i) for i in range(3)]


def test_multi_turn_with_calls_renders_the_same_either_way(tokenizer):
    prompts = []
    for by_previous_id in (True, False):
        engine = FakeEngine(tokenizer, [], max_model_len=1024)
        with TestClient(build_app(engine, None, parsers=Parsers(None, "hermes"))) as client:
            prompts.append(conversation_turns(client, engine, tokenizer, by_previous_id))
    assert prompts[0][2] == prompts[1][2]
    # (turn 2 by previous_response_id carries no tools, so only its history is compared)
    history = prompts[0][1].split("<|im_start|>user\nWeather in Paris?")[1]
    assert history == prompts[1][1].split("<|im_start|>user\nWeather in Paris?")[1]
    assert prompts[0][2].endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL}<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nIt is 21 C in Paris.<|im_end|>\n"
        "<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_item_reference_resolves_stored_items(client, engine, tokenizer):
    first = client.post("/v1/responses", json={"input": "Weather in Paris?", "tools": TOOLS}).json()
    call = first["output"][0]
    engine.scripts = [script(tokenizer, "Sunny.")]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    body = client.post(
        "/v1/responses",
        json={"input": [{"type": "item_reference", "id": call["id"]}, output], "tools": TOOLS},
    ).json()
    assert body["status"] == "completed"
    items = client.get(f"/v1/responses/{body['id']}/input_items", params={"order": "asc"}).json()["data"]
    assert items[0] == call
    assert CALL in prompt_text(engine)


def test_other_tool_types_are_ignored(client, engine, tokenizer):
    engine.scripts = [script(tokenizer, "Hi.")]
    tools = [{"type": "web_search"}, {"type": "local_shell"}, *TOOLS]
    body = client.post("/v1/responses", json={"input": "Hi", "tools": tools}).json()
    assert body["output"][0]["content"][0]["text"] == "Hi."
    assert body["tools"] == [*tools[:2], {**TOOLS[0], "strict": False}]  # echoed, function tools in full
    assert TOOLS_BLOCK in prompt_text(engine)


def test_tool_choice_none_hides_the_tools(client, engine):
    body = client.post("/v1/responses", json={"input": "Hi", "tools": TOOLS, "tool_choice": "none"}).json()
    assert "<tools>" not in prompt_text(engine)
    assert body["output"][0]["type"] == "message" and body["output"][0]["content"][0]["text"] == CALL


def test_chat_tool_calls(client, engine):
    body = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Weather?"}], "tools": CHAT_TOOLS}
    ).json()
    check(body, "CreateChatCompletionResponse")
    [choice] = body["choices"]
    [call] = choice["message"]["tool_calls"]
    assert call == {"id": call["id"], "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"


def test_chat_stream_reasoning_and_tool_calls(client, engine, tokenizer):
    engine.scripts = [script(tokenizer, "<think>Hmm.</think>" + CALL + "\n" + CALL)]
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Weather?"}], "tools": CHAT_TOOLS, "stream": True},
    )
    chunks = sse_payloads(r.text)
    assert chunks[-1] == "[DONE]"
    for chunk in chunks[:-1]:
        check(chunk, "CreateChatCompletionStreamResponse")
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hmm."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [(c["index"], c["function"]) for c in calls] == [(0, {"name": "get_weather", "arguments": ARGS})] * 1 + [
        (1, {"name": "get_weather", "arguments": ARGS})
    ]
    assert all(d.get("content", "") == "" for d in deltas)  # no markup leaks as text
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_history_with_calls_renders_as_hermes(client, engine):
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "warm"},
    ]
    client.post("/v1/chat/completions", json={"messages": messages, "tools": CHAT_TOOLS})
    assert prompt_text(engine).endswith(
        f"<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n{CALL}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert json.loads(ARGS) == {"city": "Paris"}


def test_developer_messages_are_system_for_templates_without_that_role(client, engine):
    messages = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    client.post("/v1/responses", json={"input": messages})
    assert prompt_text(engine) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_reasoning_effort_reaches_templates_that_read_it(tokenizer):
    """gpt-oss-style templates read a `reasoning_effort` kwarg: both endpoints pass it; explicit kwargs win."""
    import copy

    effort_tokenizer = copy.deepcopy(tokenizer)
    effort_tokenizer.chat_template = (
        "effort={{ reasoning_effort | default('unset') }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    engine = FakeEngine(effort_tokenizer, [script(tokenizer, "Hi.")], max_model_len=1024)
    with TestClient(build_app(engine, None)) as client:
        client.post("/v1/responses", json={"input": "Q", "reasoning": {"effort": "high"}})
        client.post("/v1/responses", json={"input": "Q"})
        client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Q"}], "reasoning_effort": "low"}
        )
        explicit = {"reasoning_effort": "minimal"}
        client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Q"}],
                "reasoning_effort": "low",
                "chat_template_kwargs": explicit,
            },
        )
    assert [prompt_text(engine, i) for i in range(4)] == [
        "effort=high|Q",
        "effort=unset|Q",
        "effort=low|Q",
        "effort=minimal|Q",
    ]
