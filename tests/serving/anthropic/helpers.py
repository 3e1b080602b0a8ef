"""What the Messages API tests share: the question, scripts, tools, and Anthropic's event stream parsed."""

from __future__ import annotations

import json

EOS = 2
MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def script(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + [EOS]


def body(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 100, "messages": QUESTION, **fields}


def events(text: str) -> list[dict]:
    """The events of an Anthropic stream, each `event: <type>` line checked against its payload's type."""
    assert text.endswith("\n\n"), text[-50:]
    out = []
    for frame in text.split("\n\n")[:-1]:
        kind, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}", frame
        out.append(payload)
    return out


def error(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}
