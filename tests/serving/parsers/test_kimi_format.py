"""The Kimi-K3 prompt format and the Kimi output parsers: exact renderings, round trips, streaming."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.rendering.kimi_k3 import (
    ASSISTANT_OPEN,
    MESSAGE_END,
    RESPONSE_OPEN,
    THINK_OPEN,
    attributes,
    render_calls,
    render_messages,
)
from hybridserve.serving.parsers import Parsers, Reasoning, Text, ToolCall
from hybridserve.serving.parsers.base import merged
from hybridserve.serving.parsers.kimi import KimiK2ToolParser, KimiK3ToolParser

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
MESSAGE = re.compile(r"<\|open\|>message([^<]*)<\|sep\|>(.*?)<\|close\|>message<\|sep\|><\|end_of_msg\|>", re.S)
RESPONSE = re.compile(r"<\|open\|>response<\|sep\|>(.*?)<\|close\|>response<\|sep\|>", re.S)


def feed_all(parser, deltas: list[str]) -> list:
    pieces = [p for d in deltas for p in parser.feed(d)]
    return merged(pieces + parser.finish())


def both_ways(make, text: str) -> list:
    """Pieces for `text` fed whole, asserting one character at a time gives the same."""
    whole = feed_all(make(), [text])
    assert feed_all(make(), list(text)) == whole
    return whole


def k3(prompt: str = ASSISTANT_OPEN + THINK_OPEN, tools: bool = True):
    return lambda: Parsers("kimi_k3", "kimi_k3").for_request(prompt, tools)


def parse_prompt(text: str) -> list[dict]:
    """A rendered conversation back into chat messages (the round-trip reader; calls via the tool parser)."""
    out = []
    for head, body in MESSAGE.findall(text):
        attrs = attributes(head)
        if attrs.get("type"):
            continue  # control blocks
        message: dict = {"role": attrs["role"]}
        if attrs["role"] == "assistant":
            found = RESPONSE.search(body)
            message["content"] = found.group(1) if found else ""
            calls = [p for p in feed_all(KimiK3ToolParser(), [RESPONSE.sub("", body)]) if isinstance(p, ToolCall)]
            if calls:
                message["tool_calls"] = [(c.name, json.loads(c.arguments)) for c in calls]
        else:
            message["content"] = body
        if attrs["role"] == "tool":
            message["name"], message["index"] = attrs["name"], int(attrs["index"])
        out.append(message)
    return out


def test_exact_rendering_with_every_control_block():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [_call("c1", "get_weather", {"city": "Paris"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    kwargs = {"thinking_effort": "max", "tool_choice": "required", "response_format": {"type": "json_object"}}
    assert render_messages(messages, [TOOL], kwargs) == (
        '<|open|>message role="system" type="tool-declare"<|sep|>```json\n'
        '[{"function":{"name":"get_weather","parameters":{"type":"object"}},"type":"function"}]\n```'
        "<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system" type="thinking-effort"<|sep|>thinking_effort=max' + MESSAGE_END + ""
        '<|open|>message role="system" type="tool-choice"<|sep|>tool_choice=required' + MESSAGE_END + ""
        '<|open|>message role="system" type="response-format"<|sep|>json_object' + MESSAGE_END + ""
        '<|open|>message role="system"<|sep|>Be brief.' + MESSAGE_END + ""
        '<|open|>message role="user"<|sep|>Weather?' + MESSAGE_END + ""
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>'
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|>" + MESSAGE_END + ""
        '<|open|>message role="tool" name="get_weather" index="1"<|sep|>sunny' + MESSAGE_END + ""
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )


def test_generation_prompt_follows_thinking_and_reasoning_is_not_rendered():
    history = [{"role": "assistant", "content": "Hi", "reasoning_content": "secret"}]
    assert render_messages([], None, {"thinking": False}).endswith(ASSISTANT_OPEN + RESPONSE_OPEN)
    assert "thinking-effort" not in render_messages([], None, {"thinking": False, "thinking_effort": "high"})
    assert "secret" not in render_messages(history, None, {})


def test_tool_choice_needs_tools_and_schema_goes_into_the_prompt():
    assert "tool-choice" not in render_messages([], None, {"tool_choice": "required"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = render_messages([], None, {"response_format": {"type": "json_schema", "schema": schema}})
    assert '```json\n{"properties":{"a":{"type":"integer"}},"type":"object"}\n```' in text


def test_tool_result_without_its_call_cannot_render():
    with pytest.raises(ValueError, match="answers no call"):
        render_messages([{"role": "tool", "tool_call_id": "x", "content": "r"}], None, {})


def test_attribute_escaping_round_trips():
    body = render_calls([_call("c", 'we"ird&name', {'k"&': "v"})])
    assert 'tool="we&quot;ird&amp;name"' in body and 'key="k&quot;&amp;"' in body
    [call] = feed_all(KimiK3ToolParser(), [body])
    assert call == ToolCall('we"ird&name', json.dumps({'k"&': "v"}))


def test_json_form_for_arguments_that_are_not_an_object():
    body = render_calls([_call("c", "f", "[1, 2]")])
    assert '<|open|>json type="object"<|sep|>[1, 2]<|close|>json<|sep|>' in body
    assert feed_all(KimiK3ToolParser(), [body]) == [ToolCall("f", "[1, 2]")]


# JSON values of every type the typed form names (strings without the format's markup)
_text = st.text(st.characters(blacklist_characters="<|", blacklist_categories=("Cs",)), max_size=12)
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(-1e3, 1e3, allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)
_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_-]{0,10}", fullmatch=True)


@st.composite
def conversations(draw) -> list[dict]:
    messages: list[dict] = []
    for turn in range(draw(st.integers(1, 4))):
        messages.append({"role": draw(st.sampled_from(["user", "system"])), "content": draw(_text)})
        calls = [
            _call(f"c{turn}-{i}", draw(_names), draw(st.dictionaries(_text, _values, max_size=3)))
            for i in range(draw(st.integers(0, 3)))
        ]
        messages.append({"role": "assistant", "content": draw(_text), **({"tool_calls": calls} if calls else {})})
        messages.extend({"role": "tool", "tool_call_id": c["id"], "content": draw(_text)} for c in calls)
    return messages


@settings(max_examples=60, deadline=None)
@given(conversations())
def test_render_then_parse_gives_back_messages_calls_and_typed_arguments(messages):
    parsed = parse_prompt(render_messages(messages, None, {}))
    expected = []
    for m in messages:
        if m["role"] == "assistant":
            item = {"role": "assistant", "content": m["content"]}
            if m.get("tool_calls"):
                item["tool_calls"] = [
                    (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]
                ]
            expected.append(item)
        elif m["role"] == "tool":
            calls = next(a["tool_calls"] for a in reversed(expected) if a["role"] == "assistant")
            index = int(m["tool_call_id"].rsplit("-", 1)[1]) + 1
            expected.append({"role": "tool", "content": m["content"], "name": calls[index - 1][0], "index": index})
        else:
            expected.append(m)
    assert parsed == expected


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(_names, st.dictionaries(_text, _values, max_size=3)), min_size=1, max_size=3), _text)
def test_streamed_assistant_turn_parses_back_to_the_same_calls(calls, reasoning):
    """What the model writes (think, response, tools) parses to the same pieces however it is split."""
    turn = [_call(str(i), name, args) for i, (name, args) in enumerate(calls)]
    body = f"{reasoning}<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|>{render_calls(turn)}"
    pieces = both_ways(k3(), body + "<|close|>message<|sep|>")
    expected = [Reasoning(reasoning)] if reasoning else []
    expected += [Text("ok"), *(ToolCall(n, json.dumps(a, ensure_ascii=False)) for n, a in calls)]
    assert pieces == expected


def test_reasoning_parser_starts_in_the_channel_the_prompt_opened():
    assert both_ways(k3(), "hm<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|>") == [
        Reasoning("hm"),
        Text("Hi"),
    ]
    thinking_off = k3(ASSISTANT_OPEN + RESPONSE_OPEN)
    assert both_ways(thinking_off, "Hi<|close|>response<|sep|><|close|>message<|sep|>") == [Text("Hi")]
    assert not thinking_off().in_reasoning and k3()().in_reasoning


def test_markup_never_leaks_into_streamed_text():
    parser = k3(ASSISTANT_OPEN + RESPONSE_OPEN)()
    deltas = ["Hi<|clo", "se|>response<|s", "ep|><|open|>to", 'ols<|sep|><|open|>call tool="f" index="1"<|sep|>']
    texts = [p.text for d in deltas for p in parser.feed(d) if isinstance(p, Text)]
    assert "".join(texts) == "Hi"
    assert parser.feed("<|close|>call<|sep|><|close|>tools<|sep|>") == [ToolCall("f", "{}")]


def test_kimi_k2_tool_sections():
    text = (
        "Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    )
    assert both_ways(KimiK2ToolParser, text) == [
        Text("Let me look."),
        ToolCall("get_weather", '{"city": "Paris"}'),
        ToolCall("get_time", "{}"),
    ]
    assert both_ways(KimiK2ToolParser, "no calls <|tool") == [Text("no calls <|tool")]


def _call(call_id: str, name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}
